import pytest
import torch

from tests.titan_lrattnres.trainer_runs import tiny_corpus_env
from titan_lrattnres import model_registry


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """Subprocess environment whose data cache holds the tiny stdlib corpus (V=1024), built
    once per session and shared by every test that launches training."""
    return tiny_corpus_env(tmp_path_factory.getbasetemp() / "lrattnres_tiny_corpus")


@pytest.fixture
def build():
    """Build and initialise a model from build_model_config kwargs, seeded."""

    def _build(flavor="debug", seed=0, dtype=torch.float32, randomize_queries=True, **kwargs):
        kwargs.setdefault("depth_backend", "reference")
        torch.manual_seed(seed)
        model = model_registry(flavor, **kwargs).model.build()  # the ModelSpec users get
        model.init_states(buffer_device=torch.device("cpu"))
        if randomize_queries:
            # zero-initialised queries make every read a plain mean; test real routing too.
            # std 1.5/sqrt(r) keeps logits O(1) (|RMSNorm(k)|² = r): sharp but well-conditioned.
            with torch.no_grad():
                for q in model.depth_queries():
                    q.normal_(0, 1.5 / q.shape[-1] ** 0.5)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        return model

    return _build
