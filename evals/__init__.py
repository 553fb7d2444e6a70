"""The eval harness, driving the public interfaces only: the groundedness and tool-use evals,
benchmarks, studies and checks (one subpackage each); ``specrag eval`` and ``specrag bench``
come from cli_commands.py."""
