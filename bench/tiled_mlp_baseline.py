"""The baseline of bench/tiled_mlp.py: the published TiledMLP algorithm (DeepSpeed ALST,
axolotl) written in plain Python, for a side-by-side comparison with the C++ op.

Forward runs the MLP shard by shard under no_grad and concatenates the shards' outputs,
saving only x. Backward re-runs each shard's forward with grad enabled and calls
torch.autograd.backward on it, so the weights' .grad accumulate shard by shard (and x's
gradient is copied into its slice).
"""

import torch


class PythonTiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp, x, num_shards):
        ctx.mlp, ctx.num_shards = mlp, num_shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp(shard) for shard in x.chunk(num_shards, dim=0)])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        start = 0
        for x_shard, grad_shard in zip(x.detach().chunk(ctx.num_shards), grad_out.chunk(ctx.num_shards)):
            x_shard = x_shard.detach().requires_grad_()
            with torch.enable_grad():
                out = ctx.mlp(x_shard)
            torch.autograd.backward(out, grad_shard)
            grad_x[start : start + x_shard.shape[0]].copy_(x_shard.grad)
            start += x_shard.shape[0]
        return None, grad_x, None


def python_tiled_mlp(mlp, x, num_shards):
    """mlp(x) over the tokens of a 2-D x (which needs a gradient) in num_shards shards, recomputed in backward."""
    return PythonTiledMLP.apply(mlp, x, num_shards)
