"""The ``ferryman`` command as a user runs it (a subprocess), on a tiny model with a byte-level
tokenizer: ``generate`` with and without ``--stream``, interactive ``chat``, and ``--help``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
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
    # a prompt that is not valid Unicode (bytes in argv) is refused before anything is echoed
    bad = [sys.executable, "-m", "ferryman", "generate", b"hi\xff", *args[2:], "--stream"]
    p = subprocess.run(bad, capture_output=True, timeout=120)
    assert p.returncode == 2 and p.stdout == b"" and b"not valid Unicode text" in p.stderr, p.stderr


def test_generate_chat_applies_the_template_and_an_empty_output_is_said(model_dir: Path) -> None:
    args = ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "6", *KNOBS]
    want = Engine(str(model_dir), block_size=4, calibrate=False).chat(
        [{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=6)
    )[0]
    assert ferryman(*args, "--chat") == want.outputs[0].text + "\n"
    assert ferryman(*args, "--chat", "--stream") == want.outputs[0].text + "\n"
    first = ferryman(*args)[len("Hello")]  # a stop string at the first character: no text
    p = subprocess.run(
        [sys.executable, "-m", "ferryman", *args, "--stop", first],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stdout == "Hello\n"
    assert "empty output for 'Hello' (finish_reason stop); an instruct model may need --chat" in p.stderr


def test_generate_follows_a_grammar_and_says_why_one_is_refused(model_dir: Path) -> None:
    args = ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "8", *KNOBS]
    for flags, ok in [
        (["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no")),
        (["--regex", "[ab]{3}"], lambda t: len(t) == 3 and set(t) <= {"a", "b"}),
        (["--json-schema", '{"enum": [1, 22]}'], lambda t: t in ("1", "22")),
    ]:
        out = ferryman(*args, *flags)
        assert out.startswith("Hello") and ok(out[len("Hello") : -1]), (flags, out)
    p = subprocess.run(
        [sys.executable, "-m", "ferryman", *args, "--regex", "(unclosed"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "error: request" in p.stderr and "structured outputs" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_chat_keeps_the_conversation_and_reset_forgets_it(model_dir: Path) -> None:
    eng = Engine(str(model_dir), block_size=4, num_device_blocks=64, num_host_blocks=0, calibrate=False)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first = eng.chat([{"role": "user", "content": "hi"}], params)[0].outputs[0].text
    second = (
        eng.chat(
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": first},
                {"role": "user", "content": "more"},
            ],
            params,
        )[0]
        .outputs[0]
        .text
    )
    fresh = eng.chat([{"role": "user", "content": "more"}], params)[0].outputs[0].text
    out = ferryman(
        "chat", "--model", str(model_dir), "--max-tokens", "6", *KNOBS, stdin="hi\nmore\n/reset\nmore\n\n"
    )
    assert out == f"> {first}\n> {second}\n> > {fresh}\n> "


def test_stream_and_chat_cut_max_tokens_to_the_room_and_a_refused_turn_is_said(model_dir: Path) -> None:
    """The tiny model's context is 256: --stream cuts --max-tokens 300 as plain generate does
    (both refused it before), and chat's default 256 too; a turn that cannot fit is said, and the
    conversation goes on."""
    args = ["generate", "Hello", "--model", str(model_dir), "--max-tokens", "300", *KNOBS]
    assert ferryman(*args, "--stream") == ferryman(*args)
    long_turn = "x" * 400  # past the context whatever the template adds
    p = subprocess.run(
        [sys.executable, "-m", "ferryman", "chat", "--model", str(model_dir), "--max-tokens", "4", *KNOBS],
        input=f"hi\n{long_turn}\nmore\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "exceeds max_model_len" in p.stderr and "/reset starts over" in p.stderr
    assert p.stdout.count("> ") == 4  # hi, the refused turn, more, and the empty line that quits
    default = subprocess.run(
        [sys.executable, "-m", "ferryman", "chat", "--model", str(model_dir), *KNOBS],
        input="hi\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert default.returncode == 0 and "exceeds" not in default.stderr, default.stderr


def test_ctrl_c_in_chat_exits_130_without_a_traceback(model_dir: Path) -> None:
    chat = [sys.executable, "-m", "ferryman", "chat", "--model", str(model_dir), *KNOBS]
    p = subprocess.Popen(chat, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    seen = b""
    while not seen.endswith(b"> "):  # the engine is up and waits for a turn
        chunk = p.stdout.read1(64)
        assert chunk, p.stderr.read() if p.stderr else ""
        seen += chunk
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and b"Traceback" not in err and b"ferryman chat: interrupted" in err, err


def test_chat_refuses_a_grammar_that_cannot_compile_before_the_first_turn(model_dir: Path) -> None:
    bad = ["--grammar", "start: foo"]
    chat = [sys.executable, "-m", "ferryman", "chat", "--model", str(model_dir), *KNOBS, *bad]
    p = subprocess.run(chat, input="hi\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown name" in p.stderr and "> " not in p.stdout, p.stderr


ENGINE_FLAGS = [
    "--model",
    "--dtype",
    "--device",
    "--block-size",
    "--max-num-batched-tokens",
    "--max-num-seqs",
    "--max-model-len",
    "--num-device-blocks",
    "--num-host-blocks",
    "--swap-space",
    "--kv-cache-memory",
    "--gpu-memory-utilization",
    "--attention-backend",
    "--enforce-eager",
    "--preemption-mode",
    "--policy",
    "--no-prefix-caching",
    "--no-chunked-prefill",
    "--seed",
    "--no-calibrate",
]


@pytest.mark.parametrize(
    ("cmd", "expect"),
    [
        ([], ["{serve,generate,chat,bench,sim,plot}", "OpenAI-compatible HTTP server"]),
        (
            ["serve"],
            [*ENGINE_FLAGS, "--port PORT", "--served-model-name", "--max-waiting", "(default: 8000)"],
        ),
        (["generate"], [*ENGINE_FLAGS, "prompt", "--stream", "--max-tokens", "(default: 64)", "--stop"]),
        (["chat"], [*ENGINE_FLAGS, "--system", "(default: 256)"]),
        (
            ["bench", "throughput"],
            ["--model", "--num-device-blocks", "every request fits", "--pool-fraction", "--repeats"],
        ),
        (["bench", "serve"], ["--base-url", "--rate", "--max-concurrency", "--dataset"]),
        (
            ["sim"],
            [
                "--gpu",
                "--model-shape",
                "--sweep",
                "--max-num-seqs",
                "--compute-efficiency",
                "the workload's longest",
            ],
        ),
        (["plot"], ["trace", "--out", "(default: trace.png)"]),
    ],
)
def test_every_command_has_help_naming_its_flags(
    cmd: list[str], expect: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert text.startswith("usage: ferryman " + " ".join(cmd))
    missing = [x for x in expect if x not in text]
    assert not missing, missing


def test_help_shows_each_engine_default() -> None:
    out = ferryman("serve", "--help")
    text = " ".join(out.split())
    for shown in [
        "tokens per KV block (default: 16)",
        "(default: 256)",
        "(default: smollm2)",
        "(default: auto)",
    ]:
        assert shown in text, shown
    assert "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS token budget of one step" in text


def test_bench_throughput_does_not_take_engine_only_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--enforce-eager"])
    assert e.value.code == 2
    assert "unrecognized arguments: --enforce-eager" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["70000", "-5"])
def test_serve_refuses_a_port_out_of_range(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # 70000 listened on 4464 while saying 70000
        main(["serve", "--port", port])
    assert e.value.code == 2 and f"must be in [0, 65535], got {port}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--data-parallel-size", "2"], "--data-parallel-size > 1 needs --ray"),
        (["--data-parallel-size", "0", "--ray"], "--data-parallel-size must be >= 1"),
        (["--ray", "--trace", "t.jsonl"], "--trace is not supported with --ray"),
        (["--routing", "prefix"], "--routing prefix needs --ray"),
    ],
)
def test_serve_refuses_data_parallel_flags_it_cannot_honour(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == 2
    assert said in capsys.readouterr().err


def test_serve_reads_vllms_spellings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `vllm serve` command line: the model as a positional, --enable-/--no-enable- switches,
    --allowed-origins as one JSON list, --uvicorn-log-level, and VLLM_API_KEY; what the server
    is then called with (its run replaced, nothing starts)."""
    from ferryman.server import run as server_run

    seen: dict[str, Any] = {}

    def serve(args: Any, **kw: Any) -> int:
        seen.update(kw, args=args)
        return 0

    monkeypatch.setattr(server_run, "serve", serve)
    monkeypatch.setenv("VLLM_API_KEY", "k")
    argv = ["serve", "some/model", "--no-enable-prefix-caching", "--enable-chunked-prefill"]
    argv += ["--allowed-origins", '["http://a.example", "http://b.example"]', "--uvicorn-log-level", "debug"]
    assert (
        main([*argv, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-requests"])
        == 0
    )
    args = seen["args"]
    assert (args.model, args.enable_prefix_caching, args.enable_chunked_prefill) == (
        "some/model",
        False,
        True,
    )
    assert seen["allowed_origins"] == ["http://a.example", "http://b.example"]
    assert (seen["log_level"], seen["api_key"], seen["tool_call_parser"]) == ("debug", "k", "hermes")
    assert main(["serve", "--allowed-origins", "http://a.example", "http://c.example"]) == 0
    assert seen["allowed_origins"] == ["http://a.example", "http://c.example"]
    assert seen["args"].enable_prefix_caching is True
    assert main(["serve", "--served-model-name", "a", "b"]) == 0
    assert seen["served_model_name"] == ["a", "b"]
    assert main(["serve", "--chat-template", "{{ messages[0]['content'] }}"]) == 0
    assert seen["chat_template"] == "{{ messages[0]['content'] }}"
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "two models given: 'a' and --model 'b'" in capsys.readouterr().err
    assert main(["serve", "--allowed-origins", '["x", 1]']) == 2
    assert "not a JSON list of origins" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a typo failed after the model loaded, with a traceback
        main(["serve", "--log-level", "bogus"])
    assert e.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_a_chat_template_flag_is_a_file_or_the_template(tmp_path: Path) -> None:
    from ferryman.server.run import template_text

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert template_text(str(f)) == f.read_text()
    assert template_text("{{ messages }}") == "{{ messages }}"
    # vLLM's rule: a name that is no file and no template is refused (it was served as the
    # template, and every message was dropped)
    with pytest.raises(ValueError, match="no such file, and not a template"):
        template_text(str(tmp_path / "missing.jinja"))


def test_serve_refuses_its_own_flags_before_loading_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN drain timeout (the drain never timed out), a template path that does not exist (it
    was served as the template) and a trace file that cannot be written (found once the model had
    loaded) are exit 2, one line, before the (here missing) model is looked at."""
    from ferryman.engine_args import EngineArgs
    from ferryman.server.run import serve

    args = EngineArgs(model="no/such/model")
    for kw, said in (
        ({"shutdown_timeout": float("nan")}, "--shutdown-timeout must be >= 0, got nan"),
        ({"chat_template": str(tmp_path / "missing.jinja")}, "no such file, and not a template"),
        ({"trace": str(tmp_path / "no" / "dir" / "t.jsonl")}, "No such file or directory"),
        ({"max_waiting": 0}, "ferryman serve: error: --max-waiting must be >= 1"),
    ):
        assert serve(args, **kw) == 2, kw  # type: ignore[arg-type]
        assert said in capsys.readouterr().err


def test_a_cpu_kv_pool_past_the_machines_memory_is_refused_by_name(tmp_path: Path) -> None:
    """On the CPU the device pool is host memory: a bare "[Errno 12] Cannot allocate memory"."""
    from ferryman import Engine, InvalidRequestError

    model = build("llama", tmp_path)
    with pytest.raises(InvalidRequestError, match="kv_cache_memory / num_device_blocks"):
        Engine(str(model), kv_cache_memory=1 << 55, calibrate=False, swap_space=0)


def test_ferryman_runs_without_ray_and_what_needs_ray_says_so() -> None:
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # import ray now fails as if it were not installed\n"
        "import ferryman.server.app, ferryman.server.run, ferryman.engine\n"
        "from ferryman.engine_setup import ray_workers\n"
        "try:\n"
        "    ray_workers()\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "from ferryman.cli import main\n"
        "sys.exit(main(['serve', '--ray', '--data-parallel-size', '2']))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--ray needs ray[serve]" in p.stderr, p.stderr
    assert "distributed_executor_backend='ray' needs ray" in p.stdout, p.stdout


def test_bad_files_and_values_are_said_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")]) == 1
    assert "No such file" in capsys.readouterr().err
    step = {"type": "step", "step": 0, "num_free_device_blocks": 5, "num_device_blocks": 10}
    step |= {"num_free_host_blocks": 0, "num_host_blocks": 0, "num_scheduled_tokens": 3, "token_budget": 8}
    step |= {"num_prefill_tokens": 0, "preemptions": [], "num_running": 1, "num_waiting": 0, "num_swapped": 0}
    for line, said in (
        ('{"type": "step"}', "has no 'step'"),
        ("[1, 2]", "a trace line is a JSON object"),
        # fields of the wrong type (TypeError tracebacks before)
        (json.dumps(step | {"num_device_blocks": "10"}), "has 'num_device_blocks' = '10', not a number"),
        (json.dumps(step | {"preemptions": None}), "'preemptions' that are not a list of events"),
        (json.dumps(step | {"preemptions": [1]}), "'preemptions' that are not a list of events"),
    ):
        trace = tmp_path / "t.jsonl"
        trace.write_text(line + "\n")
        assert main(["plot", str(trace), "-o", str(tmp_path / "x.png")]) == 2
        assert said in capsys.readouterr().err
    trace.write_text(json.dumps(step) + "\n")
    assert main(["plot", str(trace), "-o", str(tmp_path / "noext")]) == 0  # matplotlib adds .png
    assert str(tmp_path / "noext.png") in capsys.readouterr().out and (tmp_path / "noext.png").exists()
    dataset = tmp_path / "d.json"
    for rows, said in (('[{"text": "hi"}]', "row 0 is {'text': 'hi'}"), ("[1]", "row 0 is 1")):
        dataset.write_text(rows)  # read before any request: no server needed
        assert main(["bench", "serve", "--dataset", str(dataset), "--base-url", "http://127.0.0.1:9"]) == 2
        assert said in capsys.readouterr().err
    bench = ["bench", "throughput", "--model", "no/such", "--no-hf", "--num-device-blocks", "0"]
    assert main(bench) == 2  # 0 was taken as "the default" (every request fits)
    assert "num_device_blocks must be in [1, 2147483646], got 0" in capsys.readouterr().err
    sim = ["sim", "--num-requests", "5", "--model-shape", "smollm2-135m"]
    trace = tmp_path / "refused.jsonl"
    assert main([*sim, "--gpu-memory-utilization", "1e-9", "--trace", str(trace)]) == 2
    assert "leaves no KV memory" in capsys.readouterr().err and not trace.exists()  # no empty trace left
    kept = tmp_path / "kept.jsonl"
    kept.write_text('{"type": "step"}\n')  # a file that was there is the user's: left as it is
    assert main([*sim, "--gpu-memory-utilization", "1e-9", "--trace", str(kept)]) == 2
    assert kept.read_text() == '{"type": "step"}\n' and "leaves no KV memory" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []
    assert main([*sim, "--trace", str(tmp_path / "no" / "dir" / "t.jsonl")]) == 1
    assert "--trace " in capsys.readouterr().err
    for argv, said in ((["--bogus"], "unrecognized arguments: --bogus"), ([], "a command is required")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert main([*sim, "--output-len", "fixed:0"]) == 2
    assert "lengths are >= 1" in capsys.readouterr().err
    assert main([*sim, "--shape-set", "num_layers=0"]) == 2
    assert "num_layers must be > 0" in capsys.readouterr().err
    assert main([*sim, "--shape-set", "num_layers=abc"]) == 2  # a TypeError traceback before
    assert "ModelShape.num_layers must be an integer, got 'abc'" in capsys.readouterr().err
    config = tmp_path / "config.json"
    for text, said in (
        ('{"hidden_size": 64}', "is not a model's config.json: no 'num_attention_heads'"),
        ("[1, 2]", "is not a model's config.json"),
        (
            '{"num_attention_heads": 0, "hidden_size": 64, "num_hidden_layers": 2, '
            '"intermediate_size": 8, "vocab_size": 9}',
            "ModelShape.num_heads must be > 0, got 0",
        ),
    ):
        config.write_text(text)
        assert main(["sim", "--num-requests", "5", "--model-shape", str(config)]) == 2
        assert said in capsys.readouterr().err
    for flags, said in (
        (["--rate", "nan"], "rate must be > 0 (or inf), got nan"),  # before: a loop that never ended
        (["--shared-prefix", "-5"], "shared_prefix must be >= 0"),
        (["--sweep", "num_device_blocks=a"], "--sweep num_device_blocks: invalid literal"),
        (["--sweep", "num_device_blocks=100", "--trace", str(trace)], "--trace records one run"),
        (["--plot", str(tmp_path / "p.png")], "it needs --sweep"),
    ):
        assert main([*sim, *flags]) == 2
        assert said in capsys.readouterr().err
    work = tmp_path / "w.json"
    work.write_text('[{"arrival_s": -3, "prompt_len": 4, "output_len": 2}]')
    assert main(["sim", "--workload", str(work)]) == 2
    assert "arrival_s must be a finite number of seconds >= 0" in capsys.readouterr().err
    for rows, said in (  # an OverflowError traceback, a silent truncation, a wrong message before
        ('[{"prompt_tokens": [99999999999], "output_len": 2}]', "prompt_tokens are not token ids"),
        ('[{"prompt_tokens": [1.5, 2], "output_len": 2}]', "prompt_tokens are not token ids"),
        ('[{"prompt_len": 4, "output_len": 2.5}]', "2.5 is not a whole number"),
        ('[{"prompt_len": 4, "output_len": 1e12}]', "together at most 2**31"),
    ):
        work.write_text(rows)
        assert main(["sim", "--workload", str(work)]) == 2
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*sim, "--arrival", "burst", "--burst-size", "0"])
    assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    serve = (  # bench serve: refused before any request is sent
        (["--rate", "0"], "--rate must be > 0"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--input-len", "5:2"], "--input-len '5:2': want LO:HI"),
    )
    for flags, said in serve:
        assert main(["bench", "serve", "--no-progress", *flags]) == 2
        assert said in capsys.readouterr().err
    assert main(["bench", "serve", "--no-progress", "--base-url", "http://127.0.0.1:1"]) == 1
    assert "no server answers at http://127.0.0.1:1" in capsys.readouterr().err
    bench = (
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--output-len", "9:3"], "LO <= HI"),
        # the pool's size was silently the fraction's; --vs-sync compared off with off
        (["--pool-fraction", "0.5", "--num-device-blocks", "9"], "give it or --num-device-blocks, not both"),
        (["--vs-sync", "--no-async-scheduling"], "drop --no-async-scheduling"),
    )
    for flags, said in bench:
        assert main(["bench", "throughput", "--no-hf", *flags]) == 2
        assert said in capsys.readouterr().err
    if not torch.cuda.is_available():
        for device in ("cuda", "cuda:0"):  # an index reached torch's "no NVIDIA driver" first
            assert main(["generate", "hi", "--device", device]) == 2
            assert "no such CUDA GPU here (0 visible" in capsys.readouterr().err
