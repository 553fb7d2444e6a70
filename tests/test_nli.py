"""The optional NLI judge: read from a local folder only, the right label, (premise, claim) in the
right order, and the scorer's in-between band decided by it. No NLI weights ship with specrag,
so the real CrossEncoder here loads a tiny random BERT classifier built on the spot: the
probabilities are meaningless, the plumbing is real."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specrag.agent.grounding import GroundednessScorer
from specrag.agent.grounding.types import NLI_CANDIDATES
from specrag.evals.groundedness.nli import NliJudge, NliUnavailable, entailment_label
from specrag.evals.groundedness.run import main as eval_main
from specrag.evals.studies.calibrate_groundedness import main as calibrate_main
from tests.test_groundedness import SUPPORTED, WITH

LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}  # entailment last: not index 0 or 1 by luck


@pytest.fixture(scope="module")
def tiny_nli(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_nli")
    words = ["the", "a", "is", "not", "of", "to", "in", "when", "with", "block", "context", "manager"]
    words += ["enter", "exit", "return", "value", "method", "target", "invoked", "entered"]
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=5 + len(words),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
        num_labels=3,
        id2label=LABELS,
        label2id={name: index for index, name in LABELS.items()},
        initializer_range=1.0,  # far from uniform outputs, so a wrong column or order shows
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    return folder


def test_the_entailment_label_is_found_by_name_in_any_order() -> None:
    assert entailment_label(LABELS) == 2
    assert entailment_label({"0": "ENTAILMENT", "1": "neutral", "2": "contradiction"}) == 0
    assert entailment_label({0: "not_entailment", 1: "entailment"}) == 1
    with pytest.raises(NliUnavailable, match="no single entailment label"):
        entailment_label({0: "LABEL_0", 1: "LABEL_1"}, "some/folder")


def test_a_missing_folder_is_a_clear_error_and_nothing_is_downloaded(tmp_path: Path) -> None:
    with pytest.raises(NliUnavailable, match=r"--nli: no model at .*never downloaded"):
        NliJudge(tmp_path / "absent")
    with pytest.raises(NliUnavailable):
        NliJudge("cross-encoder/nli-deberta-v3-small")  # a hub id is not a folder: refused, not fetched
    (tmp_path / "config.json").write_text('{"model_type": "bert"}', encoding="utf-8")
    with pytest.raises(NliUnavailable, match=r"--nli: cannot load .*model\.safetensors"):
        NliJudge(tmp_path)  # a config without weights


def test_the_judge_reads_premise_then_claim_and_the_entailment_column(tiny_nli: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    premises = ["the context manager enter method is invoked", "the return value is not a target"]
    claim = "when the block is entered the manager enter method is invoked"
    got = NliJudge(tiny_nli).entailment(premises, claim)

    tokenizer = AutoTokenizer.from_pretrained(tiny_nli)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_nli).eval()
    with torch.no_grad():
        logits = model(**tokenizer(premises, [claim] * 2, padding=True, return_tensors="pt")).logits
    probabilities = torch.softmax(logits, dim=-1).numpy()
    expected = probabilities[:, 2]
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert not np.allclose(probabilities[:, :2], expected[:, None], atol=1e-3)  # another column would differ
    with torch.no_grad():  # the other order gives other numbers, so the check above can fail
        swapped = model(**tokenizer([claim] * 2, premises, padding=True, return_tensors="pt")).logits
    assert not np.allclose(torch.softmax(swapped, dim=-1)[:, 2].numpy(), expected, rtol=1e-4)


class _FixedNli:
    """A test double for the judge: a fixed entailment probability, and a record of what it read."""

    def __init__(self, probability: float) -> None:
        self.probability = probability
        self.calls: list[tuple[list[str], str]] = []

    def entailment(self, premises: list[str], hypothesis: str) -> np.ndarray:
        self.calls.append((list(premises), hypothesis))
        probabilities = np.zeros(len(premises))
        probabilities[-1] = self.probability  # the farthest window: the evidence must follow the argmax
        return probabilities


def test_the_judge_decides_the_in_between_band_only() -> None:
    paraphrase = SUPPORTED["paraphrase_enter"][0] + " [P1]"
    assert GroundednessScorer().score(paraphrase, [WITH]).sentences[0].reason.startswith("paraphrase")

    entails = _FixedNli(0.9)
    verdict = GroundednessScorer(nli=entails).score(paraphrase, [WITH]).sentences[0]
    assert verdict.supported and verdict.reason.startswith("entailed: NLI P=0.90")
    [(premises, hypothesis)] = entails.calls
    assert hypothesis == SUPPORTED["paraphrase_enter"][0]  # markers stripped
    assert len(premises) == NLI_CANDIDATES and verdict.evidence == premises[-1]
    assert all(window in " ".join(WITH.split()) for window in premises)

    verdict = GroundednessScorer(nli=_FixedNli(0.1)).score(paraphrase, [WITH]).sentences[0]
    assert verdict.supported is False and "NLI P≤0.10" in verdict.reason

    never = _FixedNli(0.0)  # word-for-word and planted-number sentences are decided before it
    scorer = GroundednessScorer(nli=never)
    assert scorer.score(SUPPORTED["verbatim"][0], [SUPPORTED["verbatim"][1]]).score == 1.0
    assert scorer.score("Python floats have 64 bits of precision.", [SUPPORTED["number_kept"][1]]).score == 0.0
    assert never.calls == []


def test_the_flag_runs_calibration_with_a_real_cross_encoder(
    tiny_nli: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = Path("evals/datasets/groundedness_calibration.jsonl").read_text(encoding="utf-8").splitlines()
    subset = tmp_path / "subset.jsonl"
    subset.write_text("\n".join(lines[:6]) + "\n", encoding="utf-8")
    out = tmp_path / "calibration.json"
    assert calibrate_main(["--dataset", str(subset), "--nli", str(tiny_nli), "--json", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8"))["all"]
    capsys.readouterr()
    assert calibrate_main(["--dataset", str(subset), "--nli", str(tmp_path / "absent")]) == 2
    assert "--nli: no model at" in capsys.readouterr().err


def test_the_eval_refuses_a_missing_nli_folder_before_loading_any_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--out", str(tmp_path / "out"), "--nli", str(tmp_path / "absent")]
    assert eval_main(args) == 2
    assert "eval groundedness: --nli: no model at" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
