"""After training: loading trained models (``inference``), generation, routing analysis, long
inputs, export and the variant sweep."""
