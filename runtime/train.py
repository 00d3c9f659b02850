"""Train a DFlash drafter for a target: ``python -m runtime.train --out DIR [options]``.

Prompts come from package corpora (gsm, code, code-def, chat, stdlib, pkg:DIST) and/or files; the target
regenerates every response (cached on disk); then the drafter trains on the target's
own taps. OUT receives a z-lab-format drafter (config.json + model.safetensors) that
``python -m runtime.generate --draft OUT`` uses, plus OUT/checkpoint for ``--resume``.

Runs unchanged on the CPU (float32, slowly) and on a GPU (bfloat16 compute).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from .cli import run_cli
from .defaults import default_model_path
from .errors import RuntimeErrorBase
from .loading import DTYPES, LoadedModel, load_drafter, load_target
from .training.corpora import HELDOUT_FRACTION, SOURCE_NAMES, load_prompts
from .training.data import Example, GenerationLimits, ResponseCache, cache_file, regenerated
from .training.drafter import (DrafterShape, choose_mask_token, drafter_config, grown_config, grown_drafter, new_drafter,
                               parameter_count, save_drafter)
from .training.followups import follow_up_prompts
from .training.trainer import ANCHOR_CHOICES, StepStats, Trainer, TrainSettings, can_train_on

DEFAULT_CACHE_DIR = Path("~/.cache/dflash-runtime/regenerated")
DEFAULT_SOURCES = ["gsm", "code", "code-def", "chat", "stdlib"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target: HF/MLX folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, required=True, help="output folder for the drafter and its checkpoint")
    p.add_argument("--data", nargs="+", default=DEFAULT_SOURCES, metavar="SOURCE",
                   help=f"prompt sources: {', '.join(SOURCE_NAMES)} or files (.jsonl with messages/prompt/text, "
                        "or text, one prompt a line); default: all four corpora")
    p.add_argument("--samples", type=int, default=2000, help="prompts in all, shared evenly among the sources")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response cap when regenerating")
    p.add_argument("--max-seq-len", type=int, default=1024, help="prompt + response cap")
    p.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION, help="share of prompts held out (by hash)")
    p.add_argument("--eval-samples", type=int, default=64, help="held-out sequences scored after each epoch")
    p.add_argument("--gen-batch-size", type=int, default=16, help="prompts regenerated together")
    p.add_argument("--follow-ups", type=int, default=0, metavar="N",
                   help="also continue N regenerated chats with a user's next message (multi-turn data)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="where regenerated responses are kept")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward pass (memory)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="warm-up share of all steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gamma", type=float, help="loss decay over block rows (default 7 for B=16, 4 for B=8)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[], metavar="B",
                   help="each training block's length drawn from these (each at most the drafter's block): a "
                   "drafter trained on blocks of 16 alone drafts far worse in shorter ones (BENCHMARKS.md, session 21)")
    p.add_argument("--anchors-per-seq", type=int, default=64)
    p.add_argument("--anchors", choices=ANCHOR_CHOICES, default="uniform",
                   help="uniform: anchors drawn uniformly over each response; rounds: first where the decode loop "
                   "would start its rounds with the drafter as it is (simulated at each step: mostly just past a miss, "
                   "where tau is decided), then uniform ones up to --anchors-per-seq (a forward pass more a step)")
    p.add_argument("--distill", type=float, default=0.0, metavar="SHARE",
                   help="share of each drafted row's loss that is the KL from the target's own next-token "
                   "distribution (0..1; the rest is cross-entropy on the target's greedy token)")
    p.add_argument("--init", type=Path, help="start from this drafter's weights (its layers, taps, block and mask "
                   "then replace --layers/--block-size/--mask-token-id): train an existing drafter further; "
                   "--taps then lists its taps and more, the added ones read through zero weights at first")
    p.add_argument("--grow-to", type=int, metavar="LAYERS", help="with --init: a deeper drafter, its first layers "
                   "the init's and the added ones starting as the identity (it first drafts as the init does)")
    p.add_argument("--layers", type=int, default=3, help="drafter layers")
    p.add_argument("--intermediate-size", type=int, help="drafter MLP width (default: the target's)")
    p.add_argument("--taps", type=int, nargs="+", help="0-based target layers tapped (default: z-lab's spread)")
    p.add_argument("--mask-token-id", type=int, help="mask token (default: a spare row or an unused special token)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute dtype of target and drafter: auto is float32 on the CPU, bfloat16 on a GPU")
    p.add_argument("--save-dtype", default="bfloat16", choices=list(DTYPES), help="dtype of the exported weights")
    p.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="run the step without mx.compile")
    p.add_argument("--device-check", action="store_true", help="print the device and sizes, then exit")
    args = p.parse_args(argv)
    if args.grow_to and args.init is None:
        p.error("--grow-to needs --init (the drafter to grow)")
    return args


def growing(args: argparse.Namespace) -> bool:
    """Whether the --init drafter grows (more layers or taps) before training."""
    return bool(args.grow_to or args.taps)


def compute_dtype(choice: str) -> str:
    """float32 on the CPU (half precision is emulated there), bfloat16 on a GPU."""
    if choice != "auto":
        return choice
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


@dataclass
class Run:
    """What a run is made of, once the target is loaded and the drafter built."""

    target: LoadedModel
    config: dict[str, Any]
    dtype: str


def prepare(args: argparse.Namespace) -> Run:
    dtype = compute_dtype(args.dtype)
    target = load_target(args.model or default_model_path(), dtype=dtype)
    if args.init is not None:
        config = json.loads((args.init / "config.json").read_text())
        config.pop("quantization", None)  # a packed drafter (runtime.training.pack) trains unpacked
        args.block_size = int(config["dflash_config"].get("block_size", config.get("block_size", args.block_size)))
        return Run(target, grown_config(config, args.grow_to, args.taps) if growing(args) else config, dtype)
    mask_id = args.mask_token_id if args.mask_token_id is not None else choose_mask_token(target.model.args, target.tokenizer)
    shape = DrafterShape(args.layers, args.block_size, args.intermediate_size, tuple(args.taps or ()) or None)
    return Run(target, drafter_config(target.model.args, shape, mask_id), dtype)


def summary(run: Run, args: argparse.Namespace, drafter_params: int) -> str:
    t, c, dflash = run.target.model.args, run.config, run.config["dflash_config"]
    mask_text = run.target.tokenizer.decode([dflash["mask_token_id"]])
    return "\n".join([
        f"device   {mx.default_device()}  compute {run.dtype}  export {args.save_dtype}  compile {not args.no_compile}",
        f"target   {run.target.name} ({run.target.format}): {t.num_hidden_layers} layers, hidden {t.hidden_size}, "
        f"vocab {t.vocab_size}",
        f"drafter  {c['num_hidden_layers']} layers, {c['num_attention_heads']}/{c['num_key_value_heads']} heads x "
        f"{c['head_dim']}, MLP {c['intermediate_size']}, {drafter_params / 1e6:.1f}M params; taps "
        f"{dflash['target_layer_ids']}; block {dflash['block_size']}; mask {dflash['mask_token_id']} {mask_text!r}",
        f"training {args.epochs} epochs, batch {args.batch_size} (micro {args.micro_batch}), {args.anchors_per_seq} "
        f"anchors/seq ({args.anchors}), lr {args.lr} (warm-up {args.warmup:.0%}, cosine), clip {args.grad_clip}, distill {args.distill}, "
        f"seed {args.seed}",
        f"data     {' '.join(args.data)}: {args.samples} prompts, {args.follow_ups} follow-ups, responses <= "
        f"{args.max_new_tokens} new tokens, sequences <= {args.max_seq_len}",
    ])


def regenerate(run: Run, args: argparse.Namespace) -> list[Example]:
    limits = GenerationLimits(args.max_new_tokens, args.max_seq_len)
    cache = ResponseCache(cache_file(args.cache_dir.expanduser(), run.target.content_hash(), run.dtype))
    prompts = load_prompts(args.data, args.samples, args.seed)
    model, tokenizer = run.target.model, run.target.tokenizer
    pairs = regenerated(model, tokenizer, prompts, limits, cache, args.heldout_fraction, args.gen_batch_size)
    if args.follow_ups:
        turns = follow_up_prompts(pairs, tokenizer, args.follow_ups, args.seed)
        pairs += regenerated(model, tokenizer, turns, limits, cache, args.heldout_fraction, args.gen_batch_size)
    return [example for _, example in pairs]


def data_summary(examples: list[Example]) -> str:
    lines = []
    for split in ("train", "heldout"):
        part = [e for e in examples if e.split == split]
        sources = ", ".join(f"{name} {n}" for name, n in sorted(Counter(e.source for e in part).items()))
        lines.append(f"{split:8} {len(part)} sequences, {sum(len(e) for e in part)} tokens ({sources})")
    return "\n".join(lines)


def progress_postfix(stats: StepStats) -> dict[str, str]:
    return {"loss": f"{stats.loss:.3f}", "lr": f"{stats.lr:.2e}", "tok/s": f"{stats.tokens / stats.seconds:.0f}",
            "s/step": f"{stats.seconds:.2f}"}


def train(run: Run, args: argparse.Namespace, trainer: Trainer, heldout: list[Example]) -> None:
    checkpoint = args.out / "checkpoint"
    fingerprint = trainer.fingerprint({"drafter": run.config})
    if args.resume and checkpoint.exists():
        trainer.load_checkpoint(checkpoint, fingerprint)

    def save() -> None:
        trainer.save_checkpoint(checkpoint, fingerprint)
        save_drafter(args.out, trainer.master, run.config, args.save_dtype)

    with tqdm(total=trainer.total_steps, initial=trainer.step, desc="training", unit="step") as bar:
        while trainer.step < trainer.total_steps:
            stats = trainer.train_step()
            bar.set_postfix(progress_postfix(stats))
            bar.update(1)
            if stats.step % args.save_every == 0:
                save()
            if stats.step % trainer.steps_per_epoch == 0 and heldout:
                bar.write(f"epoch {stats.step // trainer.steps_per_epoch}: held-out {trainer.evaluate(heldout)}")
    save()
    print(f"drafter written to {args.out} (use it: python -m runtime.generate --draft {args.out})")


def refuse_overwriting(args: argparse.Namespace) -> None:
    """Fail before any regeneration, not after: a run never silently restarts over another."""
    if (args.out / "checkpoint").exists() and not args.resume:
        raise RuntimeErrorBase(f"{args.out / 'checkpoint'} exists: pass --resume to continue it, or choose another --out")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    refuse_overwriting(args)
    run = prepare(args)
    dtype = DTYPES[run.dtype]
    if args.init is not None:
        drafter = load_drafter(args.init, run.target, fuse=False)  # checks the pair; weights in the compute dtype
        if growing(args):
            drafter = grown_drafter(drafter, run.config, args.seed, dtype).bind(run.target.model)
    else:
        drafter = new_drafter(run.config, args.seed, dtype).bind(run.target.model)
    print(summary(run, args, parameter_count(drafter)))
    if args.device_check:
        return
    examples = regenerate(run, args)
    print(data_summary(examples))
    block = args.block_size
    train_set = [e for e in examples if e.split == "train" and can_train_on(e, block)]
    heldout = [e for e in examples if e.split == "heldout" and can_train_on(e, block)][: args.eval_samples]
    settings = TrainSettings(
        epochs=args.epochs, batch_size=args.batch_size, micro_batch=args.micro_batch,
        anchors_per_seq=args.anchors_per_seq, lr=args.lr, warmup_fraction=args.warmup,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, gamma=args.gamma, seed=args.seed,
        compile=not args.no_compile, block_sizes=tuple(args.block_sizes), distill=args.distill,
        anchors=args.anchors,
    )
    trainer = Trainer(run.target.model, drafter, train_set, settings, dtype)
    print(f"steps    {trainer.total_steps} ({trainer.steps_per_epoch} per epoch)")
    train(run, args, trainer, heldout)


if __name__ == "__main__":
    run_cli(main)
