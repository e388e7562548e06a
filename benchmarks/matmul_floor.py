"""The matrix products of one decode step, alone: the ceiling they put on decode tokens/s.

Runs only the projections and the LM head of the default model (as loaded by cellbatch,
so on the same packed weights) for ROWS decode rows, twice: over all layers' weights, as
a real step streams them from memory, and over the first layer's weights repeated, which
stay in cache. Prints the time, the GFLOP/s and the tokens/s that a step made only of
these products would reach.

    python benchmarks/matmul_floor.py [--rows 32] [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

from cellbatch.model.decoder_layer import PROJECTIONS
from cellbatch.model.default import default_model_path
from cellbatch.model.loading import load_model


def products(
    model: torch.nn.Module, layers: Sequence[torch.nn.Module], rows: int
) -> tuple[Callable[[], None], int]:
    """A function running one step's products for `rows` rows, and its FLOP count."""
    config = model.config
    hidden = torch.randn(rows, config.hidden_size, dtype=model.dtype)
    wide = torch.randn(rows, config.intermediate_size, dtype=model.dtype)
    attended = torch.randn(rows, config.num_heads * config.head_dim, dtype=model.dtype)
    inputs = {"qkv": hidden, "o_proj": attended, "gate_up": hidden, "down": wide}

    def step() -> None:
        for layer in layers:
            for name in PROJECTIONS:
                getattr(layer, name)(inputs[name])
        model._logits(hidden)

    h, inter = config.hidden_size, config.intermediate_size
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * inter
    per_row = per_layer * len(layers) + h * config.vocab_size
    return step, 2 * rows * per_row


def seconds_per_call(step: Callable[[], None], repeats: int) -> float:
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, model = load_model(default_model_path(), args.dtype, quantize="none")  # float products
    layers = list(model.layers)
    cases = {
        "all layers (weights streamed)": layers,
        "layer 0 repeated (weights in cache)": [layers[0]] * len(layers),
    }
    print(f"{args.dtype}, {args.rows} rows, {args.threads} threads: products of one decode step")
    with torch.no_grad():
        for label, chosen in cases.items():
            step, flop = products(model, chosen, args.rows)
            # On the thread that loaded the model: a second OpenMP team would make libgomp
            # stop spinning between parallel regions (cellbatch.threads) and slow every call.
            elapsed = seconds_per_call(step, args.repeats)
            print(
                f"  {label:<36} {elapsed * 1e3:7.1f} ms  {flop / elapsed / 1e9:6.0f} GFLOP/s  "
                f"ceiling {args.rows / elapsed:7.0f} tokens/s"
            )


if __name__ == "__main__":
    main()
