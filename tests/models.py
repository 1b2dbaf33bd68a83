"""Small models several test files train: a GPT-style stack of pre-norm attention blocks."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers=4, vocab=13, dim=16, context=8):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def train_regression(make_model, device: str, mode: str, batches: list, steps: int = 6, lr: float = 1e-2):
    """Train make_model() with AdamW on MSE over batches[:steps] in `mode` on `device`;
    (losses as floats, launches of each step, the parameters on the CPU). The model and the
    data are made from fixed seeds, so CPU and neuron runs compare bit for bit."""
    import adaptive_eager
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = [(x.to(device), y.to(device)) for x, y in batches[:steps]]
    losses, per_step = [], []
    with adaptive_eager.mode(mode):
        adaptive_eager.reset_stats()
        for x, y in data:
            before = adaptive_eager.stats().launches
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            per_step.append(adaptive_eager.stats().launches - before)
        losses = [float(v) for v in losses]
    return losses, per_step, [p.detach().cpu() for p in model.parameters()]


def neuron_steps_matching_cpu(train) -> list[int]:
    """Run train(device, mode) (train_regression's triple) on the CPU, then on neuron in eager
    and adaptive mode; assert both give the CPU's losses and parameters bit for bit, and return
    the launches of each adaptive step."""
    cpu_losses, _, cpu_params = train("cpu", "eager")
    for mode in ("eager", "adaptive"):
        losses, per_step, params = train("neuron", mode)
        assert losses == cpu_losses, mode
        assert all(torch.equal(a, b) for a, b in zip(params, cpu_params)), mode
    return per_step


def regression_batches(shape_x, shape_y, steps: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape_x, generator=g), torch.randn(shape_y, generator=g)) for _ in range(steps)]
