"""The groundedness eval (``specrag eval groundedness``): the runner (``run.py``), per-question
metrics and their summary, the report and plots, the optional NLI judge, and the abstention
trade-off."""
