"""The ``ferryman`` command as a user runs it (a subprocess), on a tiny model with a byte-level
tokenizer: ``generate`` with and without ``--stream``, interactive ``chat``, and ``--help``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build

from ferryman.cli import main
from ferryman.engine import Engine
from ferryman.sampling_params import SamplingParams

KNOBS = ["--block-size", "4", "--num-device-blocks", "64", "--num-host-blocks", "0", "--no-calibrate"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("cli"), tokenizer=True)


def ferryman(*args: str, stdin: str = "") -> str:
    p = subprocess.run(
        [sys.executable, "-m", "ferryman", *args], input=stdin, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_generate_streamed_equals_plain(model_dir: Path) -> None:
    args = ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "10", *KNOBS]
    plain = ferryman(*args)
    assert plain.startswith("Hello") and plain.endswith("\n")
    assert ferryman(*args, "--stream") == plain


def test_chat_keeps_the_conversation_and_reset_forgets_it(model_dir: Path) -> None:
    eng = Engine(str(model_dir), block_size=4, num_device_blocks=64, num_host_blocks=0, calibrate=False)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first = eng.chat([{"role": "user", "content": "hi"}], params).outputs[0].text
    second = (
        eng.chat(
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": first},
                {"role": "user", "content": "more"},
            ],
            params,
        )
        .outputs[0]
        .text
    )
    fresh = eng.chat([{"role": "user", "content": "more"}], params).outputs[0].text
    out = ferryman(
        "chat", "--model", str(model_dir), "--max-tokens", "6", *KNOBS, stdin="hi\nmore\n/reset\nmore\n\n"
    )
    assert out == f"> {first}\n> {second}\n> > {fresh}\n> "


@pytest.mark.parametrize(
    "cmd",
    [[], ["serve"], ["generate"], ["chat"], ["bench", "throughput"], ["bench", "serve"], ["sim"], ["plot"]],
)
def test_every_command_has_help(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    assert "usage: ferryman" in capsys.readouterr().out


def test_every_engine_knob_is_a_flag_with_the_engines_default() -> None:
    """``add_engine_args`` + ``engine_kwargs`` cover every keyword of ``Engine`` (the model is the
    positional argument), and parsing no flags gives the Engine's own defaults."""
    import argparse
    import inspect

    from ferryman.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    got = engine_kwargs(p.parse_args([]))
    params = {k: v.default for k, v in inspect.signature(Engine.__init__).parameters.items()}
    del params["self"], params["model"]
    assert got == params
    flagged = engine_kwargs(p.parse_args(["--enforce-eager", "--attention-backend", "torch"]))
    assert flagged["enforce_eager"] is True and flagged["attention_backend"] == "torch"
