"""The command line's argument types: each bad value is an argparse error naming what is wanted."""
from __future__ import annotations

import argparse

from ..core.choices import Policy


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def positive_epochs(text: str) -> float:
    """A number of epochs > 0 (fractions allowed, as the Trainer takes them)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--epochs must be > 0, got {text}")
    return value


def policy_name(text: str) -> Policy:
    """One of the policies, by name."""
    try:
        return Policy.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
