"""The ``ferryman`` command. For now one subcommand, ``generate`` (issue 4 adds serve, chat,
bench and plot)."""

from __future__ import annotations

import argparse
import sys

from ferryman.model_loader import DEFAULT_MODEL
from ferryman.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ferryman", description="ferryman LLM serving engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete a prompt and print the text")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    g.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2', a .gguf file or a Hugging Face folder")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-device-blocks", type=int, default=None)
    g.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"])
    a = p.parse_args(argv)
    from ferryman.engine import Engine

    engine = Engine(a.model, num_device_blocks=a.num_device_blocks, preemption_mode=a.preemption_mode)
    params = SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, max_tokens=a.max_tokens
    )
    for prompt, out in zip(a.prompt, engine.generate(a.prompt, params), strict=True):
        sys.stdout.write(prompt + out.outputs[0].text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
