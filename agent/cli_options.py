"""Command-line pieces shared by ``specrag ask``/``serve`` and the eval commands."""

from __future__ import annotations

import argparse
from typing import Any


def probability(text: str) -> float:
    """An argparse type: a float within [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], not {text}")
    return value


def add_grounding_arguments(parser: argparse.ArgumentParser) -> None:
    """The groundedness check's options (agent/grounding/check.py), for ``ask`` and the eval."""
    from specrag.agent.grounding.check import DEFAULT_MIN_SUPPORTED, GROUNDING_MODES

    parser.add_argument(
        "--grounding",
        choices=GROUNDING_MODES,
        default="mark",
        help="check the answer against the passages: mark it (default), abstain when unsupported, or off",
    )
    parser.add_argument(
        "--min-supported",
        type=probability,
        default=DEFAULT_MIN_SUPPORTED,
        help="share of the answer's claims the passages must support for it to be grounded",
    )
    parser.add_argument(
        "--grounding-judge", action="store_true", help="the model also judges each claim the rules let through"
    )


def grounding_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"grounding": args.grounding, "min_supported": args.min_supported, "grounding_judge": args.grounding_judge}
