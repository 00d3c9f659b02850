"""SmolLM2-135M-Instruct (the real default model) against an independent implementation.

tests/data/smollm2_reference.json was made once by tests/reference/make_smollm2_reference.py:
Hugging Face transformers 5.24 + torch 2.13 on the CPU in float32, loading the same GGUF
(transformers dequantizes it itself), greedy with raw logits. Our float32 path must
produce the same token ids, and the chosen token's logit within LOGIT_TOLERANCE.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from protocol import GenerationParams
from runtime.loading import LoadedModel
from runtime.plain import generate_plain, run_to_end

REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text())
CASES = {case["name"]: case for case in REFERENCE["cases"]}
LOGIT_TOLERANCE = 2e-3  # float32 vs float32, different kernels and summation orders
EOS = 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_ids_equal_the_transformers_reference(smollm2: LoadedModel, name: str) -> None:
    case = CASES[name]
    prompt = smollm2.tokenizer.encode(case["rendered"], add_special_tokens=False)
    assert prompt == case["prompt_ids"]
    want = [t for t in case["greedy_ids"] if t != EOS]
    params = GenerationParams(max_tokens=len(case["greedy_ids"]))
    result = run_to_end(generate_plain(smollm2.model, smollm2.tokenizer, prompt, params), len(prompt))
    assert result.token_ids == want
    assert result.finish_reason == ("stop" if case["stopped_at_eos"] else "length")


@pytest.mark.parametrize("name", ["chat_code_reverse", "text_nonascii", "chat_emoji_cjk"])
def test_top1_logits_agree_with_the_reference_within_tolerance(smollm2: LoadedModel, name: str) -> None:
    case = CASES[name]
    ids = case["prompt_ids"] + case["greedy_ids"]
    logits = smollm2.model(mx.array([ids])).logits[0, len(case["prompt_ids"]) - 1 : -1]
    chosen = mx.take_along_axis(logits, mx.array(case["greedy_ids"])[:, None], axis=-1)[:, 0]
    worst = max(abs(a - b) for a, b in zip(chosen.tolist(), case["top1_logits"]))
    assert worst < LOGIT_TOLERANCE


def test_france_chat_answer(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False)
    result = run_to_end(generate_plain(smollm2.model, tok, prompt, GenerationParams(max_tokens=32)), len(prompt))
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason == "stop"
