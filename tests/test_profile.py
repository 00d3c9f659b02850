"""python -m runtime.profile on tiny float32 fixtures: every step is timed, eager and compiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime import profile


def test_profile_times_every_step_eager_and_compiled_and_profiles_both_modes(
        tiny_llama_dir: Path, tiny_drafter_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--dtype", "float32",
                  "--context", "40", "--reps", "2", "--max-tokens", "8", "--top", "3"])
    report = json.loads(capsys.readouterr().out)
    for setting in ("eager", "compiled"):
        parts = report[setting]["parts"]
        for step in ("verify", "draft", "round", "plain_token"):
            assert parts[step]["ops"] > 0 and parts[step]["synced_ms"] > 0 and parts[step]["queued_ms"] > 0
            assert 0 < parts[step]["build_ms"]
        assert parts["round"]["ops"] > parts["verify"]["ops"]  # a round is a draft and a verify
        assert sum(parts["verify"]["top_ops"].values()) <= parts["verify"]["ops"]
        assert "QuantizedMatmul" in parts["verify"]["top_ops"] or "Matmul" in parts["verify"]["top_ops"]
        for chain in ("verify_chain_waited", "verify_chain_read_previous", "verify_chain_read_two_back",
                      "verify_chain_queued"):
            assert parts[chain]["per_step_ms"] > 0
        for mode in ("pipelined", "sequential"):
            engine = report[setting]["engine"][mode]
            assert engine["tokens_per_s"] > 0 and len(engine["top_ms_per_round"]) == 3
    # the compiled verify fuses what the eager one runs op by op
    assert report["compiled"]["parts"]["verify"]["ops"] < report["eager"]["parts"]["verify"]["ops"]
