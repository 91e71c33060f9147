"""Small plain-torch models shared by the tests."""

import torch


class TransformerLayer(torch.nn.Module):
    """Pre-norm attention + MLP block, written with plain torch ops."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).transpose(1, 3).unbind(2)
        attn = torch.softmax(q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5), dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyTransformer(torch.nn.Module):
    def __init__(self, layers=3, width=32):
        super().__init__()
        self.layers = torch.nn.ModuleList(TransformerLayer(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x, layer_fn=None):
        for layer in self.layers:
            x = layer(x) if layer_fn is None else layer_fn(layer, x)
        return self.head(x)
