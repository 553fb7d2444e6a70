"""An optional NLI judge for the groundedness scorer: a cross-encoder read from a local folder.

No NLI weights ship with specrag and none are ever downloaded (``local_files_only``): the flag
(``specrag eval groundedness --nli DIR``, ``python -m specrag.evals.studies.calibrate_groundedness --nli DIR``)
takes any Hugging Face sequence-classification folder whose ``config.json`` names an
entailment label (``id2label``), e.g. an MNLI-trained cross-encoder copied onto the machine.
With it, a sentence in the scorer's uncertain band (some but not most of its words in the
evidence) is supported when a passage sentence entails it, instead of when one is close in
MiniLM meaning: entailment sees "allowed" vs "forbidden", a cosine does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


class NliUnavailable(ValueError):
    """The folder is missing or is not an NLI classifier; the message says which."""


class NliJudge:
    """P(premise entails hypothesis) for (passage sentence, claim) pairs."""

    def __init__(self, folder: str | Path, device: str = "cpu") -> None:
        path = Path(folder)
        if not (path / "config.json").is_file():
            raise NliUnavailable(
                f"--nli: no model at {path} (config.json missing); NLI weights are never downloaded, "
                "pass a local cross-encoder folder"
            )
        from sentence_transformers import CrossEncoder

        try:
            self._model = CrossEncoder(str(path), local_files_only=True, device=device)
        except (OSError, ValueError) as error:  # no weights, no tokenizer, an unknown model type
            raise NliUnavailable(f"--nli: cannot load {path}: {error}") from error
        self.folder = str(path)
        self.entailment_index = entailment_label(self._model.config.id2label, path)

    def entailment(self, premises: Sequence[str], hypothesis: str) -> np.ndarray:
        """One probability per premise (softmax over the classifier's labels)."""
        if not premises:
            return np.zeros(0)
        pairs = [(premise, hypothesis) for premise in premises]
        probabilities = self._model.predict(pairs, apply_softmax=True, convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(probabilities, dtype=np.float64).reshape(len(pairs), -1)[:, self.entailment_index]


def entailment_label(id2label: dict[int, str] | dict[str, str], folder: str | Path = "") -> int:
    """Index of the label that means entailment (MNLI heads name it; the order varies by model,
    and two-way heads also carry "not_entailment")."""
    matches = [int(index) for index, name in id2label.items() if str(name).lower().startswith("entail")]
    if len(matches) != 1:
        raise NliUnavailable(
            f"--nli: {folder} is not an NLI classifier: its labels {sorted(id2label.values())} "
            "name no single entailment label"
        )
    return matches[0]
