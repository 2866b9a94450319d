"""``python -m titan_lrattnres.evaluation.lm_eval_tasks``: print the task folder (for
``lm_eval --include_path``)."""

from titan_lrattnres.evaluation.lm_eval_tasks import task_dir

if __name__ == "__main__":
    print(task_dir())
