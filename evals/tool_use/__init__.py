"""The tool-use eval (``specrag eval tools``): the runner (``run.py``) and the tools it offers
(``suite.py``)."""
