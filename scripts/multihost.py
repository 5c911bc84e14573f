"""Sharded generation on one host or many: run this same script once per host (docs/architecture.md#multi-host).

    # every host of a TPU pod slice (the coordinator is found from the environment):
    python scripts/multihost.py --mesh data=4,model=8 --model /path/to/Llama-3.1-8B-Instruct --method snapkv
    # GPU hosts: name the coordinator, the process count and this process's id
    python scripts/multihost.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 --mesh data=2,model=8
    # one process (what the tests run):
    python scripts/multihost.py --single-process --mesh data=2,model=4

``jax.distributed.initialize()`` runs first (skipped with ``--single-process``); the mesh is then built over
``jax.devices()``, every process's devices; every process loads the model, generates for the same prompts and
process 0 prints the tokens.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--single-process", action="store_true", help="skip jax.distributed.initialize()")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (default: from the environment)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--mesh", default=None, metavar="data=N,model=M", help="default: every device on 'data'")
    p.add_argument("--model", default="smollm2-135m-instruct", help="local HF folder, .gguf, or the embedded model")
    p.add_argument("--method", default="snapkv")
    p.add_argument("--budget", default="0.5", help="fraction of each prompt (0.5) or tokens (256)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt", action="append", default=None, help="repeatable; default: as many as 'data' needs")
    args = p.parse_args(argv)

    import jax

    if not args.single_process:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    import kvjax
    from kvjax import methods, sharding
    from kvjax.budget import parse_budget

    mesh = sharding.make_mesh(args.mesh)
    model = kvjax.load_model(args.model, mesh=mesh)
    dp = sharding.axis_size(mesh, sharding.DATA)
    prompts = args.prompt or [f"Count from {i} to {i + 5}:" for i in range(dp)]
    if model.tokenizer is None:  # a checkpoint without tokenizer files: token ids
        prompts = [[1 + (ord(c) % (model.config.vocab_size - 1)) for c in text] for text in prompts]
    method = methods.at_budget(args.method, parse_budget(args.budget))
    out = kvjax.generate(model, prompts, method, args.max_new_tokens, stop_at_eos=False)
    if jax.process_index() == 0:
        print(f"process 0 of {jax.process_count()}: {sharding.describe(mesh, model.config)}")
        for tokens in out.tokens:
            print(tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
