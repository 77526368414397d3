"""The benchmark workloads as an ordinary PyTorch user writes them, and their training step.

Nothing here knows about the bridge: the same code runs as torch eager, under torch.compile,
and under the bridge (eager or captured).
"""

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

GPT2_SMALL = dict(layers=12, heads=12, width=768, vocab=50304, block=1024)
GPT2_TINY = dict(layers=2, heads=4, width=64, vocab=512, block=64)


class SelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, width))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 (nanoGPT's layout): learned positions, pre-norm blocks, tied embedding and head."""

    def __init__(self, layers, heads, width, vocab, block):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def gpt_setup(device, config, batch):
    torch.manual_seed(0)
    model = GPT(**config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    x = torch.randint(0, config["vocab"], (batch, config["block"]), device=device)
    y = torch.randint(0, config["vocab"], (batch, config["block"]), device=device)
    return model, optimizer, (x, y)


def _no_mark(phase):
    pass


def gpt_step(model, optimizer, data, bf16, mark=_no_mark):
    """One training step. `mark(phase)` is called as each phase ends (host time per phase:
    benchmarks/profile_step.py --phases)."""
    x, y = data
    with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        _, loss = model(x, y)
    mark("forward")
    optimizer.zero_grad(set_to_none=True)
    mark("zero_grad")
    loss.backward()
    mark("backward")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    mark("clip")
    optimizer.step()
    mark("optimizer")
    value = loss.item()
    mark("item")
    return value


def resnet_setup(device, batch, size=224, tiny=False):
    import torchvision

    torch.manual_seed(0)
    model = (torchvision.models.resnet18(num_classes=10) if tiny else torchvision.models.resnet50()).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10 if tiny else 1000, (batch,), device=device)
    return model, optimizer, (x, y)


def resnet_step(model, optimizer, data, bf16, mark=_no_mark):
    x, y = data
    with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        loss = F.cross_entropy(model(x), y)
    mark("forward")
    optimizer.zero_grad(set_to_none=True)
    mark("zero_grad")
    loss.backward()
    mark("backward")
    optimizer.step()
    mark("optimizer")
    value = loss.item()
    mark("item")
    return value
