"""What an applied step's forward holds between modules: at the end of a layer's attention and of its MLP, the
activations Python can reach, by what they are, beside the resident set's growth.

    .venv/bin/python bench/forward_holders.py [--tokens 16384,32768] [--layer 4] [--write]

The step is the layers' path of bench/long_context.py's forward (the demo's Llama, `apply(model,
chunk_recurrent=False)`, whose chunk-recurrent step would otherwise take it, one row of T tokens,
after a 128-token training step), one fresh process per T, with glibc returning every block of 1 MiB or more when
it is freed, so that the resident set's growth is the live bytes. When the chosen layer's attention and MLP return
(their forward hooks), every tensor the garbage collector reaches whose storage has 1 MiB or more and was not
there before the forward (the weights and views of them were) is counted once per storage, named by what it is
to the layer: its input (which the model's own loop and its call of the layer hold through the layer; apply's loop
drops it at the first residual add), the module's input and output,
else the autograd node that made it. The resident growth beside the reached total shows what Python cannot reach
(the library's own buffers, tensors the disk tier has not written yet); it can come out a little below the total,
as the step reuses blocks the warm-up freed.
"""

import argparse
import collections
import gc
import json
import subprocess
import sys
import warnings
import weakref

from measure import demo_llama, machine, reset_peak_rss, status_bytes, worker_env, write_section

TITLE = "What the forward holds between modules"


def census(model, layer_index, tokens):
    import torch

    layer = model.model.layers[layer_index]
    held = {}  # the end ("attention" or "MLP") -> {holder: bytes}, with the resident growth
    # The layer's input, its module's input and output: weak references, as the layer's input dies in apply's loop
    # (its address then serves a later tensor).
    seen = {}

    def reached():
        storages = {}
        warnings.simplefilter("ignore", FutureWarning)  # isinstance() on torch.distributed's deprecated reduce_op
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                if storage.nbytes() >= 1 << 20:
                    storages.setdefault(storage.data_ptr(), (storage.nbytes(), obj))
        return storages

    def name(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        for role in ("the layer's input", "the module's input", "the module's output"):
            alive = seen.get(role, lambda: None)()
            if alive is not None and alive.untyped_storage().data_ptr() == pointer:
                return role
        if tensor.grad_fn is None:
            shape = ", ".join("T" if size == tokens else str(size) for size in tensor.shape)
            return f"no autograd node, [{shape}]"
        return tensor.grad_fn.name().removeprefix("torch::autograd::CppNode<").split("::")[-1].rstrip(">")

    def at_end(end):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            seen["the module's input"] = weakref.ref(args[0] if args else kwargs["hidden_states"])
            seen["the module's output"] = weakref.ref(out)
            holders = collections.Counter()
            for pointer, (nbytes, tensor) in reached().items():
                if pointer not in before_step:
                    holders[name(tensor)] += nbytes
            holders["resident growth"] = status_bytes("VmRSS") - before
            held[end] = dict(holders)

        return hook

    def layer_input(module, args, kwargs):
        seen["the layer's input"] = weakref.ref(args[0] if args else kwargs["hidden_states"])

    # On the layer's first norm, whose input is the layer's: a hook on the layer would send apply's loop over the
    # layers back to the model's own (docs/apply.md, "The loop over the layers").
    layer.input_layernorm.register_forward_pre_hook(layer_input, with_kwargs=True)
    layer.self_attn.register_forward_hook(at_end("attention"), with_kwargs=True)
    layer.mlp.register_forward_hook(at_end("MLP"), with_kwargs=True)
    ids = torch.randint(3, 32000, (1, tokens), generator=torch.Generator().manual_seed(0))
    # The model's own (its weights and their views), held here so that no new tensor takes their address.
    before_step = reached()
    before = reset_peak_rss()
    model(input_ids=ids, labels=ids, use_cache=False)
    return held


def worker(tokens, layer_index):
    import torch

    import torch_offload

    torch.manual_seed(0)
    model = demo_llama(512, 1408, 8, tokens).train()
    torch_offload.apply(model, chunk_recurrent=False)
    warm = torch.randint(3, 32000, (1, 128), generator=torch.Generator().manual_seed(1))
    model(input_ids=warm, labels=warm, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    return census(model, layer_index, tokens)


def table(results, args):
    ends = ("attention", "MLP")
    names = dict.fromkeys(n for r in results.values() for end in ends for n in r[end] if n != "resident growth")
    columns = [(t, end) for t in results for end in ends]
    header = " | ".join(f"{t // 1024}K, after the {end}" for t, end in columns)
    lines = [f"| held | {header} |", "| --- |" + " ---: |" * len(columns)]

    def cell(t, nbytes):
        vector = t * 512 * 4  # one [T, hidden] float32 tensor
        return f"{nbytes / 2**20:.0f} ({nbytes / vector:.2f})"

    for n in names:
        lines.append(f"| {n} | " + " | ".join(cell(t, results[t][end].get(n, 0)) for t, end in columns) + " |")
    reached = {(t, end): sum(v for k, v in results[t][end].items() if k != "resident growth") for t, end in columns}
    lines.append("| **reached from Python** | " + " | ".join(cell(t, reached[t, end]) for t, end in columns) + " |")
    lines.append(
        "| **resident growth** | "
        + " | ".join(cell(t, results[t][end]["resident growth"]) for t, end in columns)
        + " |"
    )
    command = "`.venv/bin/python bench/forward_holders.py " + " ".join(sys.argv[1:]) + "`"
    return (
        f"## {TITLE}\n\n{command} ({machine()}). Layer {args.layer} of the demo's Llama (hidden 512, 8 layers, "
        "float32) with `apply(model, chunk_recurrent=False)`, in the forward of one step per fresh process, every "
        "block of 1 MiB or more returned when freed: when its attention and its MLP return, the tensors Python reaches "
        "(1 MiB or more, each storage once, none of the weights') by what they are, in MiB and in `[T, 512]` float32 "
        "vectors.\n\n" + "\n".join(lines) + "\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16384,32768")
    parser.add_argument("--layer", type=int, default=4)
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        json.dump(worker(args.run, args.layer), sys.stdout)
        return
    results = {}
    for tokens in map(int, args.tokens.split(",")):
        command = [sys.executable, __file__, "--run", str(tokens), "--layer", str(args.layer)]
        out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, env=worker_env()).stdout
        results[tokens] = json.loads(out)
        print(tokens, {end: v["resident growth"] >> 20 for end, v in results[tokens].items()}, flush=True)
    text = table(results, args)
    print(text)
    if args.write:
        write_section(TITLE, text)


if __name__ == "__main__":
    main()
