"""Random op programs give bit-identical results in adaptive and eager mode.

Each program is generated from a seed as plain Python source (a failure prints the listing,
and a shrunk one): a few neuron tensors and views of them (slices, transpose, view/reshape,
expand), then a loop whose body (3-15 statements) repeats 2-12 times, so the engine detects
it, caches it and replays it as fused launches. The body mixes elementwise ops, reductions,
matmuls, linalg ops and ops that return nothing (_assert_async), other dtypes, in-place
updates (add_, mul_, copy_, index_put_, masked_fill_, out= (into outs that the op resizes
too), setitem; also through views and into values the loop produced), random ops (dropout,
rand_like, bernoulli_, normal_, randperm, multinomial), lifted Python-float scalars that
change every iteration, CPU 0-dim tensors as scalars (also mutated after use), host reads
(item, tolist, print, bool, repr, equal, copies to the CPU), synchronize(), host-to-device
copies whose CPU source is mutated right after, data-dependent shapes, a second device,
autograd steps, references dropped, aliasing that changes between iterations, ping-pong
buffers, and divergent iterations (another op or shape).

Everything the program reads back, every tensor it holds at the end (values bit for bit,
shapes, strides, dtypes, devices) and the state of the generator neuron's random ops draw from
(torch.get_rng_state()) must be the same in both modes.
Programs with only device ops in the body must also have been fused (stats().fused_launches).

Own generator rather than hypothesis: programs are source text from the start (the
listing *is* the reproducer), a seed names a program, and the shrinker below works on
statements, iterations and setup lines, which is what a reader wants; hypothesis'
shrinking of a draw tree would cost more of the 60 s budget than the programs themselves.
"""
from __future__ import annotations

import gc
import io
import random
import re
import time

import pytest
import torch

import adaptive_eager
from adaptive_eager.mode import SWITCH

N_PROGRAMS = 300
SHAPE_PROGRAMS = 60
GROWING_PROGRAMS = 40
CHAIN_PROGRAMS = 30
SHRINK_SECONDS = 20.0

# Random ops on neuron draw from torch's default CPU generator, a deferred one at issue (Note
# [Deferred random ops draw at issue]), so programs read, reseed and draw from it on the host
# without an explicit synchronize (False would add one).
RNG_CALLS_SYNC = True
_RNG_READ = ("out.append(torch.get_rng_state())" if RNG_CALLS_SYNC else
             "torch.neuron.synchronize(); out.append(torch.get_rng_state())  # sync: see RNG_CALLS_SYNC")

# The storage each setup name lives in (views share their base's).
_BASES = {"a_rows": "a", "a_r": "a", "b_t": "b", "w_v": "w", "vec_e": "vec", "big_even": "big", "big_hi": "big"}

# Shapes the generator tracks (every operand it picks has a known shape).
M, N, S, V, R, H, Z = (4, 6), (6, 4), (4, 4), (6,), (4,), (2, 6), ()


# ---------------------------------------------------------------------------------------
# The generator: a program is a header (setup lines), a body (statements), and rep count.
# ---------------------------------------------------------------------------------------
class Program:
    def __init__(self, seed, setup, body, reps, diverges):
        self.seed = seed
        self.setup = setup  # list of source lines before the loop
        self.body = body  # list of statements (each a list of source lines, loop-indented later)
        self.reps = reps
        self.diverges = diverges  # some iteration takes a different op or shape

    def source(self) -> str:
        lines = [f"# program seed={self.seed} reps={self.reps}", "def program(out, buf):"]
        lines += ["    " + s for s in self.setup]
        lines.append(f"    for i in range({self.reps}):")
        lines.append("        lr = 0.5 / (i + 1)  # lifted scalar, changes every iteration")
        lines.append("        cs = torch.tensor(0.25 * i - 0.5)  # CPU 0-dim tensor used as a scalar")
        for stmt in self.body:
            lines += ["        " + s for s in stmt]
        lines.append("    return {k: v for k, v in locals().items() if isinstance(v, torch.Tensor)}  # all it holds")
        return "\n".join(lines) + "\n"

    def replace(self, body=None, reps=None, setup=None) -> "Program":
        return Program(self.seed, self.setup if setup is None else setup, self.body if body is None else body,
                       self.reps if reps is None else reps, self.diverges)

    def without_unused_setup(self) -> "Program":
        """The setup lines whose name nothing else mentions, dropped (for a shorter reproducer)."""
        setup = list(self.setup)
        while True:
            text = lambda skip: "\n".join(l for l in setup if l is not skip) + repr(self.body)  # noqa: E731
            unused = [l for l in setup[1:] if not re.search(rf"\b{l.split(' = ')[0]}\b", text(l))]
            if not unused:
                return self.replace(setup=setup)
            setup.remove(unused[-1])


class _Gen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.seed = seed
        self.pool: dict[str, tuple] = {}  # name -> shape (readable values)
        self.writable: dict[str, tuple] = {}  # name -> shape (in-place targets: bases and views)
        self.n_tmp = 0
        self.bases = dict(_BASES)  # name -> the name whose storage it views
        self.diverges = False
        self.uses_grad = False
        self.may_swap = False
        self.reps = 2  # set by generate() before the body: guards pick iterations below it

    # -- setup ---------------------------------------------------------------------------
    def setup(self) -> list[str]:
        r = self.rng
        lines = [
            f"g = torch.Generator().manual_seed({self.seed})  # CPU data for the program",
            "a = torch.randn(4, 6, generator=g).to('neuron')",
            "b = torch.randn(6, 4, generator=g).to('neuron')",
            "w = torch.randn(4, 6, generator=g).to('neuron')",
            "big = torch.randn(8, 6, generator=g).to('neuron')",
            "vec = torch.randn(6, generator=g).to('neuron')",
            "h = torch.zeros(4, 6, device='neuron')  # carried by rebinding",
            "p = torch.randn(4, 6, generator=g).to('neuron').requires_grad_()  # a leaf parameter",
            "mask = (torch.arange(24).reshape(4, 6) % 3 == 0).to('neuron')",
            "idx = torch.tensor([0, 3]).to('neuron')",
            "c1 = torch.randn(4, 6, generator=g).to('neuron:1')  # on a second device",
        ]
        for name, shape in (("a", M), ("b", N), ("w", M), ("vec", V)):
            self.pool[name] = shape
            self.writable[name] = shape
        self.pool["h"] = M
        views = [
            ("a_rows = a[1:3]  # writable slice view", "a_rows", H, True),
            ("b_t = b.t()  # writable transposed view", "b_t", M, True),
            ("big_even = big[::2]  # strided rows", "big_even", M, True),
            ("big_hi = big[4:]  # view at an offset", "big_hi", M, True),
            ("w_v = w.view(6, 4)  # view with another shape", "w_v", N, True),
            ("a_r = a.reshape(6, 4)  # reshape of a contiguous tensor: a view", "a_r", N, True),
            ("vec_e = vec.expand(4, 6)  # expanded: read only", "vec_e", M, False),
            ("s0 = big.sum()  # a 0-dim neuron tensor", "s0", Z, False),
        ]
        for line, name, shape, writable in r.sample(views, r.randint(2, len(views))):
            lines.append(line)
            self.pool[name] = shape
            if writable:
                self.writable[name] = shape
        return lines

    # -- operand helpers -----------------------------------------------------------------
    def pick(self, shape) -> str:
        names = [n for n, s in self.pool.items() if s == shape]
        return self.rng.choice(names)

    def as_m(self) -> str:
        """An expression of shape (4, 6) from any operand in the pool."""
        r = self.rng
        name = r.choice(list(self.pool))
        shape = self.pool[name]
        if shape == M:
            return name
        if shape == N:
            return r.choice([f"{name}.t()", f"{name}.reshape(4, 6)"])
        if shape == S:
            return f"({name} @ {self.pick(M)})"
        if shape == V:
            return f"{name}.expand(4, 6)"
        if shape == R:
            return f"{name}[:, None].expand(4, 6)"
        if shape == H:
            return f"{name}.repeat(2, 1)"
        return f"({name} * {self.pick(M)})"

    def new(self, shape, writable: bool = True) -> str:
        name = f"t{self.n_tmp}"
        self.n_tmp += 1
        self.pool[name] = shape
        if writable and shape != Z:
            self.writable[name] = shape  # a fresh value (deferred in adaptive mode) written in place later
        return name

    def view_of(self):
        """A view made inside the loop, often of a value the loop produced: written through later."""
        r = self.rng
        src = r.choice([n for n, s in self.writable.items() if s in (M, N)])
        base = self.bases.get(src, src)
        line, shape = r.choice([(f"{src}[::2]", None), (f"{src}.t()", None), (f"{src}[1:3]", None),
                                (f"{src}.reshape(-1)[:24].view(4, 6)", M)])
        shape = shape or {"[::2]": (self.writable[src][0] // 2, self.writable[src][1]),
                          ".t()": self.writable[src][::-1],
                          "[1:3]": (2, self.writable[src][1])}[line[len(src):]]
        if shape not in (M, N, H):
            x = self.as_m()
            return [f"{self.new(M)} = {x} * 2"]
        name = self.new(shape)
        self.bases[name] = base
        return [f"{name} = {line}  # view"]

    def typed(self):
        """Other dtypes on the way: bf16/half rounding, integer arithmetic, bool masks."""
        r = self.rng
        x, y = self.as_m(), self.as_m()
        expr = r.choice([
            f"({x}.bfloat16() * lr).float()", f"({x}.half() + {y}.half()).float()",
            f"(({x} * 10).long() % 3).float()", f"({x} > {y}).float() * lr",
            f"{x}.masked_fill({x} < 0, lr)", f"{x}.index_select(0, idx).repeat(2, 1)",
            f"torch.add({x}, {y}, alpha=2).to(torch.float64).sum(1, keepdim=True).float().expand(4, 6)",
        ])
        return [f"{self.new(M, writable='expand' not in expr)} = {expr}"]

    def data_dependent(self):
        """Ops whose output shape depends on values: they run now (a sync inside the trace)."""
        x = self.as_m()
        expr = self.rng.choice([f"{x}[{x} > 0].sum()", f"{x}.nonzero().float().sum()",
                                f"torch.masked_select({x}, mask).mean()"])
        return [f"{self.new(Z)} = {expr}"]

    def alias_flip(self):
        """An operand that aliases a tensor in some iterations and is a copy in others."""
        target = self.rng.choice([n for n, s in self.writable.items() if s == M])
        u = self.new(M)
        self.bases[u] = self.bases.get(target, target)
        parity = self.rng.choice(["i % 2 == 0", "i < 3", "i % 3 == 1"])
        return [f"{u} = {target} if {parity} else {target}.clone()  # aliasing changes between iterations",
                f"{u}.mul_(lr)", f"{self.new(M)} = {target} + {u}"]

    def allow_swap(self) -> None:
        """Before the body: a and w may trade tensors, so every statement (also the ones before
        the swap, which run after it in the next iteration) must treat them as one storage."""
        self.may_swap = True
        for n, base in list(self.bases.items()):
            if base == "w":
                self.bases[n] = "a"
        self.bases["w"] = "a"

    def swap(self):
        """Ping-pong buffers: the names trade tensors every iteration."""
        if not self.may_swap:
            return self.elementwise()
        return ["a, w = w, a  # ping-pong"]

    def factory(self):
        """Factories and ops that take a Python float where a tensor or number goes (lifted)."""
        x = self.as_m()
        expr = self.rng.choice([
            "torch.full((4, 6), lr, device='neuron')", "torch.zeros(4, 6, device='neuron').add_(lr)",
            f"torch.full_like({x}, lr) * {x}", f"{x}.abs().pow(lr)", f"{x}.new_ones(4, 6) / (lr + 1)",
            f"torch.arange(24, device='neuron').view(4, 6) * lr + {x}",
        ])
        return [f"{self.new(M)} = {expr}"]

    def host_mutation(self):
        """The CPU 0-dim scalar changes on the host after ops that used it were issued."""
        return ["cs.add_(1.0)  # host mutation after use: issued ops keep the old value"]

    def drop(self):
        """The last reference to a value goes away (deferred in adaptive mode: its buffer is freed)."""
        temps = [n for n in self.pool if n.startswith("t")]
        if not temps:
            return self.elementwise()
        name = self.rng.choice(temps)
        self.pool.pop(name)
        self.writable.pop(name, None)
        return [f"{name} = None  # drop the reference"]

    def other_device(self):
        """A detour through neuron:1 (device-to-device copies both ways)."""
        x = self.as_m()
        return [f"{self.new(M)} = ({x}.to('neuron:1') * c1).to('neuron:0')"]

    def grad_step(self):
        """An autograd step on a leaf parameter: backward, an update under no_grad, grads reset."""
        x = self.as_m()
        self.uses_grad = True
        reset = self.rng.choice(["p.grad = None", "p.grad.zero_()"])
        return [f"loss = (p * {x}).tanh().sum()", "loss.backward()", "with torch.no_grad():",
                "    p.add_(p.grad, alpha=-lr)", reset]

    # -- statements ----------------------------------------------------------------------
    def elementwise(self):
        r = self.rng
        x, y = self.as_m(), self.as_m()
        expr = r.choice([
            f"{x} + {y}", f"{x} - {y}", f"{x} * {y}", f"torch.maximum({x}, {y})",
            f"torch.where({x} > {y}, {x}, {y})", f"{x} / ({y}.abs() + 1)", f"torch.tanh({x})",
            f"{x}.relu()", f"torch.sigmoid({x})", f"{x}.sqrt()", f"torch.exp({x}.clamp(max=3))",
            f"{x} * {self.pick(V)}", f"torch.softmax({x}, -1)", f"{x}.pow(2) - {y}",
        ])
        return [f"{self.new(M)} = {expr}"]

    def scalar(self):
        r = self.rng
        x, y = self.as_m(), self.as_m()
        expr = r.choice([
            f"{x} * lr", f"{x}.add({y}, alpha=lr)", f"{x} * cs", f"{x} + cs", f"{x} - lr * {y}",
            f"{x} * {self.pick(Z)}" if Z in self.pool.values() else f"{x} / (1 + lr)",
            f"torch.clamp({x}, -lr, lr)",
        ])
        return [f"{self.new(M)} = {expr}"]

    def reduction(self):
        r = self.rng
        x = self.as_m()
        expr, shape = r.choice([
            (f"{x}.sum(0)", V), (f"{x}.mean(1)", R), (f"{x}.sum()", Z), (f"{x}.amax()", Z),
            (f"{x}.var(1)", R), (f"torch.logsumexp({x}, 1)", R), (f"{x}.norm()", Z),
            (f"{x}.max(0).values", V), (f"{x}.argmax(1).float()", R),
        ])
        return [f"{self.new(shape)} = {expr}"]

    def matmul(self):
        r = self.rng
        x = self.as_m()
        expr, shape = r.choice([
            (f"{x} @ {self.pick(N)}", S), (f"{x} @ {self.as_m()}.t()", S),
            (f"{x} @ {self.pick(V)}", R),
            (f"torch.addmm({self.pick(M)}, {x} @ {self.pick(N)}, {self.pick(M)}, alpha=lr)", M),
        ])
        return [f"{self.new(shape)} = {expr}"]

    def inplace(self):
        r = self.rng
        target = r.choice(list(self.writable))
        shape = self.writable[target]
        src = self.pick(shape) if r.random() < 0.5 else None
        if src is None or src == target:
            src = self.as_m() if shape == M else f"{target}.flip(0)"
        if src != target and self.overlaps(src, target):
            src = f"{src}.clone()"  # a partly overlapping source is an error in eager mode too
        choices = [
            f"{target}.add_({src}, alpha=lr)", f"{target}.mul_(0.9)", f"{target}.mul_(lr)",
            f"{target}.copy_({src})", f"{target}.clamp_(-2, 2)", f"{target}.addcmul_({src}, {src}, value=lr)",
            f"{target}.sub_(cs)", f"{target}[1] = {src}[0]", f"{target}.tanh_()",
            # out= ops: into outs of the result's sizes, views among them, and into an out
            # that is also an input
            f"torch.add({src}, lr, out={target})", f"torch.where({src} > 0, {target}, {src}, out={target})",
        ]
        if shape == M:
            rows = f"{src}[:2].clone()" if self.overlaps(src, target) else f"{src}[:2]"
            choices += [f"{target}.masked_fill_(mask, lr)", f"{target}.index_put_((idx,), {rows})",
                        f"{target}.masked_fill_(mask, 0.0)", f"torch.mul({src}, lr, out={target})",
                        # an out the op resizes: a sync point each time
                        f"e = {target}.new_empty(0); torch.mul({src}, lr, out=e); {target}.add_(e)"]
        if shape == H:
            choices.append(f"{target}.masked_fill_(mask[:2], -lr)")
        return [r.choice(choices)]

    def overlaps(self, expr: str, target: str) -> bool:
        base = self.bases.get(target, target)
        return any(self.bases.get(n, n) == base for n in re.findall(r"[A-Za-z_]\w*", expr))

    def carry(self):
        x = self.as_m()
        return [f"h = h * 0.5 + {x}"]

    def random_op(self):
        r = self.rng
        kind = r.randrange(9)
        if kind >= 7:
            method = r.choice(["bernoulli_(0.5)", "uniform_(-lr, lr)", "normal_(0, lr)"])
            return [f"{r.choice(list(self.writable))}.{method}"]
        x = self.as_m()
        expr = [f"torch.nn.functional.dropout({x}, p=0.3, training=True)",
                f"torch.rand_like({x})", f"{x} + torch.randn_like({x})",
                "torch.randn(4, 6, device='neuron')", "torch.randperm(24, device='neuron').view(4, 6).float()",
                f"torch.multinomial(torch.nan_to_num({x}, 1.0, 1.0, 1.0).abs() + 0.1, 6).float()",
                f"{x} * torch.bernoulli(torch.full_like({x}, 0.5))",
                ][kind]
        return [f"{self.new(M)} = {expr}"]

    def host_read(self):
        r = self.rng
        name = r.choice(list(self.pool))
        read = r.choice([
            f"out.append({name}.sum().item())", f"out.append({name}.tolist())",
            f"print({name}, file=buf)", f"out.append(bool(({name} > 0).any()))",
            f"out.append(float({name}.max()))", f"out.append({name}.cpu())",
            f"out.append({name}.detach().cpu().numpy().tolist())", f"out.append(torch.equal({name}, {name} * 1))",
            f"out.append(repr({name}))",
            f"out.append(torch.zeros({name}.shape).copy_({name}))  # copy_ into a CPU tensor",
            _RNG_READ,
            _RNG_READ.replace("out.append(torch.get_rng_state())", "torch.manual_seed(i)"),
            _RNG_READ.replace("out.append(torch.get_rng_state())", "out.append(torch.rand(3))  # a host draw"),
        ])
        return self.guard([read])

    def sync(self):
        return self.guard(["torch.neuron.synchronize()"])

    def h2d(self):
        r = self.rng
        src = f"src{self.n_tmp}"
        blocking = r.choice(["", ", non_blocking=True"])
        if r.random() < 0.5 or not any(s == M for s in self.writable.values()):
            dst = self.new(M)
            first = f"{dst} = {src}.to('neuron'{blocking})"
        else:
            dst = r.choice([n for n, s in self.writable.items() if s == M])
            first = r.choice([f"{dst}.copy_({src}{blocking})", f"{dst}[1:3] = {src}[:2]",
                              f"{dst}.add_({src}.to('neuron'{blocking}))"])
        return [f"{src} = torch.randn(4, 6, generator=g)", first,
                f"{src}.add_(1000.0)  # the device must hold the value at issue time"]

    def guard(self, lines):
        """Host-side statements: every iteration, or only at some."""
        r = self.rng
        if r.random() < 0.4:
            return lines
        its = sorted(r.sample(range(self.reps), min(self.reps, r.randint(1, 3))))
        return [f"if i in {tuple(its)}:"] + ["    " + s for s in lines]

    def divergent(self):
        """An iteration that takes a different op (or shape) to produce the same value name."""
        r = self.rng
        self.diverges = True
        x, y = self.as_m(), self.as_m()
        name = self.new(M)
        alt = r.choice([
            f"{name} = {x} - {y}",
            f"{name} = ({x}.reshape(6, 4) * 2).reshape(4, 6)",
            f"{name} = torch.cat([{x}[:2], {y}[2:]])",
            f"{name} = {x}.repeat(2, 1)[2:6] + {y}",
        ])
        its = sorted(r.sample(range(1, self.reps), min(self.reps - 1, r.randint(1, 2))))
        return [f"if i in {tuple(its)}:  # divergent iteration", "    " + alt, "else:", f"    {name} = {x} + {y}"]

    def kernel(self):
        """The shipped custom kernels (attention, RMSNorm): one op each in a trace."""
        x, y, z = self.as_m(), self.as_m(), self.as_m()
        r = self.rng
        options = r.choice(["is_causal=True", "attn_mask=mask[:, :4]", "dropout_p=0.25", "scale=lr"])
        expr = r.choice([
            f"torch.nn.functional.scaled_dot_product_attention({x}[None], {y}[None], {z}[None], {options})[0]",
            f"torch.nn.functional.rms_norm({x}, (6,), {self.pick(V)}, eps=1e-5)",
        ])
        return [f"{self.new(M)} = {expr}"]

    def linalg(self):
        """linalg ops on a well-conditioned matrix (their error checks, _linalg_check_errors,
        return nothing), and ops that return nothing at all (_assert_async)."""
        r = self.rng
        x = f"torch.nan_to_num({self.as_m()}).clamp(-3, 3)"
        if r.random() < 0.25:
            return [f"torch._assert_async(({x}.abs().sum() >= 0), 'a sum of magnitudes is never negative')"]
        spd = f"({x} @ {x}.t() + 4 * torch.eye(4, device='neuron'))"
        expr, shape = r.choice([
            (f"torch.linalg.cholesky({spd})", S), (f"torch.linalg.solve({spd}, {self.as_m()})", M),
            (f"torch.linalg.inv({spd})", S), (f"torch.linalg.det({spd})", Z),
            (f"torch.linalg.qr({x}.t()).Q", N),
        ])
        return [f"{self.new(shape)} = {expr}"]

    def changing_shape(self, setup: list[str], growing: bool = False):
        """Shapes that change every iteration in a regular way (issue 15): a cache grown by a row
        per iteration and read by attention over all of it (decoding's KV cache), and a length
        that cycles (batches of varying length). Only values of a fixed shape enter the pool.
        growing=True: the growing cache only."""
        r = self.rng
        x = self.as_m()
        tag = self.n_tmp
        self.n_tmp += 1
        if growing or r.random() < 0.5:
            cache = f"kv{tag}"
            setup.append(f"{cache} = torch.zeros(0, 6, device='neuron')  # grows a row per iteration")
            row = r.choice([f"{x}[:1]", f"{x}[i % 4:i % 4 + 1] * lr"])
            query = self.as_m()  # before the new name exists: a statement never reads its own result
            return [f"{cache} = torch.cat([{cache}, {row}])  # a growing cache, as in decoding",
                    f"{self.new(M)} = torch.softmax({query} @ {cache}.t(), -1) @ {cache}"]
        n = f"n{tag}"
        expr = r.choice([f"torch.nn.functional.pad({x}[:, :{n}], (0, 6 - {n}))",
                         f"{x}[:{n} - 1].sum(0, keepdim=True).expand(4, 6) * lr"])
        return [f"{n} = 2 + (i * 3) % 4  # a length that cycles: 2, 5, 4, 3", f"{self.new(M)} = {expr}"]

    def statement(self, pure_only: bool):
        r = self.rng
        makers = [(self.elementwise, 5), (self.scalar, 4), (self.reduction, 3), (self.matmul, 3),
                  (self.inplace, 6), (self.carry, 1), (self.random_op, 2), (self.view_of, 2),
                  (self.typed, 2), (self.grad_step, 0.7), (self.factory, 1.5), (self.kernel, 1),
                  (self.linalg, 1)]
        if not pure_only:  # these sync, add no device op, or make iterations differ: may never fuse
            makers += [(self.host_mutation, 0.5), (self.drop, 1), (self.alias_flip, 1), (self.swap, 3),
                       (self.host_read, 2), (self.sync, 0.5), (self.h2d, 1), (self.divergent, 1),
                       (self.data_dependent, 0.5), (self.other_device, 0.5)]
        maker = r.choices([m for m, _ in makers], [w for _, w in makers])[0]
        return maker()



@pytest.fixture(autouse=True, scope="module")
def _no_garbage_of_earlier_tests():
    # Each run compares the device's total memory: garbage of earlier test files (cycles holding
    # neuron tensors, e.g. the OpInfo sweep's) must be gone first, or the mode run first counts it.
    gc.collect()


def generate(seed: int, style: str | None = None) -> Program:
    """style 'pure': a body of device ops only (no host reads, syncs, copies, divergent or
    aliasing-flipping iterations, dropped references), so the engine must fuse it. style
    'shapes': a program with statements whose shapes change every iteration added first and
    last. (Only that style draws them: a seed's default program, FOUND_BY_SEARCH's included,
    stays what it was.) style 'growing': a 'pure' body between two caches that grow a row
    per iteration, so no iteration repeats an exact shape: a shape-generic trace must fuse it."""
    growing = style == "growing"
    style = "pure" if growing else style
    gen = _Gen(seed)
    r = gen.rng
    gen.reps = r.randint(3, 12) if style == "pure" else r.randint(2, 12)
    if growing:
        gen.reps = max(gen.reps, 6)  # two sightings, adoption, then iterations to fuse
    setup = gen.setup()
    if style != "pure" and r.random() < 0.1:
        gen.allow_swap()
    # Statements of changing shapes first read setup names only; the last ones, anything defined.
    first = [gen.changing_shape(setup) for _ in range(r.randint(0, 2))] if style == "shapes" else []
    if growing:
        first = [gen.changing_shape(setup, growing=True)]
    # A pure body has at least 4 statements: the engine's shortest trace is 4 ops (min_trace_len).
    body = [gen.statement(pure_only=style == "pure") for _ in range(r.randint(4 if style == "pure" else 3, 15))]
    if style == "shapes":
        body = first + body + [gen.changing_shape(setup) for _ in range(r.randint(1, 2))]
    if growing:
        body = first + body + [gen.changing_shape(setup, growing=True)]
    reps = gen.reps
    if style == "pure" and gen.uses_grad:
        reps = max(reps, 4)  # the first backward differs (no .grad yet): one more iteration to settle
    if gen.uses_grad:
        body.append(["pg = p.grad"])  # the gradient left by the last step (None after p.grad = None)
    return Program(seed, setup, body, reps, gen.diverges)


# ---------------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------------
def _compile(src: str):
    namespace = {"torch": torch}
    exec(compile(src, "<random program>", "exec"), namespace)
    return namespace["program"]


def _fresh_engine():
    """A program's adaptive run starts from an empty trace cache, so its listing reproduces it."""
    with adaptive_eager.mode("eager"):  # launches anything pending before the engine forgets it
        SWITCH.adaptive.reset()


def run(program: Program, mode: str, fresh: bool = True):
    """Run in `mode`; returns (reads, final tensors on the host, RNG state, error, stats)."""
    fn = _compile(program.source())
    previous = adaptive_eager.get_mode()
    if fresh and mode == "adaptive":
        _fresh_engine()
    try:
        adaptive_eager.set_mode(mode)
        adaptive_eager.reset_stats()
        torch.manual_seed(1234)
        out, buf = [], io.StringIO()
        try:
            held = fn(out, buf)
            if not RNG_CALLS_SYNC:
                torch.neuron.synchronize()
            rng = torch.get_rng_state().clone()  # the generator neuron's random ops draw from
            final = {k: _host(v) for k, v in held.items()}
            # What the live tensors hold on the device: the engine keeps nothing extra alive
            # once synchronized, and counts each storage once, as eager mode does.
            final["(device memory allocated)"] = repr(torch.neuron.memory_allocated())
            error = None
        except Exception as exc:  # both modes must fail alike
            rng, final, error = None, {}, f"{type(exc).__name__}: {exc}"
        reads = [_host(x) for x in out] + [buf.getvalue()]
        return reads, final, rng, error, adaptive_eager.stats()
    finally:
        adaptive_eager.set_mode(previous)


def _host(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.detach().cpu().clone(), tuple(x.shape), x.stride(), x.dtype, str(x.device))
    return repr(x)  # repr of floats/bools/lists is exact (round-trips), nan included


def differences(eager, adaptive) -> list[str]:
    (r1, f1, g1, e1, _), (r2, f2, g2, e2, _) = eager, adaptive
    found = []
    if e1 != e2:
        found.append(f"error: eager {e1!r} vs adaptive {e2!r}")
    if len(r1) != len(r2):
        found.append(f"{len(r1)} host reads in eager, {len(r2)} in adaptive")
    for k, (x, y) in enumerate(zip(r1, r2)):
        msg = _diff(x, y)
        if msg:
            found.append(f"host read #{k}: {msg}")
    if f1.keys() != f2.keys():
        found.append(f"final names differ: {sorted(f1)} vs {sorted(f2)}")
    for k in f1.keys() & f2.keys():
        msg = _diff(f1[k], f2[k])
        if msg:
            found.append(f"final tensor {k}: {msg}")
    if (g1 is None) != (g2 is None) or g1 is not None and not torch.equal(g1, g2):
        found.append("RNG state (torch.get_rng_state(), which neuron's random ops draw from) differs at the end")
    return found


def _diff(x, y):
    if isinstance(x, tuple) and isinstance(y, tuple):
        if x[2:] != y[2:]:
            return f"metadata (shape, stride, dtype, device) eager {x[2:]} vs adaptive {y[2:]}"
        try:
            torch.testing.assert_close(y[1], x[1], rtol=0, atol=0, equal_nan=True)
        except AssertionError as exc:
            return f"values differ: {str(exc).splitlines()[0:4]}"
        if x[1].is_floating_point() and not torch.equal(_bits(x[1]), _bits(y[1])):
            return "values differ in their bits (the sign of a zero, or a NaN payload)"
        return None
    if x != y:
        return f"eager {str(x)[:200]} vs adaptive {str(y)[:200]}"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints)


def _fails(program: Program) -> bool:
    try:
        eager = run(program, "eager")
        if eager[3] is not None:  # a candidate that breaks the program itself is not a reproducer
            return False
        return bool(differences(eager, run(program, "adaptive")))
    except Exception:
        return False


def shrink(program: Program) -> Program:
    """Greedy: drop statements, then iterations, while adaptive still differs from eager."""
    deadline = time.monotonic() + SHRINK_SECONDS
    best = program
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for k in reversed(range(len(best.body))):
            cand = best.replace(body=best.body[:k] + best.body[k + 1:])
            if cand.body and time.monotonic() < deadline and _fails(cand):
                best, changed = cand, True
        for reps in range(2, best.reps):
            if time.monotonic() < deadline and _fails(best.replace(reps=reps)):
                best, changed = best.replace(reps=reps), True
                break
    pruned = best.without_unused_setup()
    return pruned if time.monotonic() < deadline and _fails(pruned) else best


_HOW_TO_RUN = (
    "To reproduce: paste the listing, then for mode in ('eager', 'adaptive'): "
    "adaptive_eager.set_mode(mode); torch.manual_seed(1234); out, buf = [], io.StringIO(); "
    "held = program(out, buf); compare out, buf.getvalue(), held and torch.get_rng_state(). "
    "In this file: run(generate(seed), mode) and differences(...).")


def check(program: Program, fresh: bool = True, context: str = ""):
    """Eager vs adaptive on one program; on a difference, fail with the listing (and a shrunk one)."""
    eager = run(program, "eager")
    assert eager[3] is None, f"the generated program fails in eager mode ({eager[3]}):\n{program.source()}"
    adaptive = run(program, "adaptive", fresh=fresh)
    found = differences(eager, adaptive)
    if found:
        small = shrink(program) if fresh else program  # shrinking needs a fresh engine per try
        pytest.fail("adaptive mode differs from eager mode:\n  " + "\n  ".join(found[:8]) + context
                    + f"\n\nprogram:\n{program.source()}\nshrunk (still differs):\n{small.source()}\n"
                    + _HOW_TO_RUN, pytrace=False)
    return adaptive[4]


# ---------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(N_PROGRAMS))
def test_random_program_matches_eager(seed):
    check(generate(seed))


@pytest.mark.parametrize("seed", range(1000, 1050))
def test_pure_repeating_program_matches_eager_and_fuses(seed):
    program = generate(seed, style="pure")
    stats = check(program)
    assert stats.fused_launches > 0, (
        f"a body repeated {program.reps} times without host reads or divergences was never "
        f"fused (stats: {stats}):\n{program.source()}")


@pytest.mark.parametrize("seed", range(3000, 3000 + SHAPE_PROGRAMS))
def test_program_whose_shapes_change_every_iteration_matches_eager(seed):
    check(generate(seed, style="shapes"))


@pytest.mark.parametrize("seed", range(4000, 4000 + GROWING_PROGRAMS))
def test_pure_program_whose_caches_grow_every_iteration_matches_eager_and_fuses(seed):
    program = generate(seed, style="growing")
    stats = check(program)
    report = adaptive_eager.explain()
    hits = sum(t.hits for t in report.traces + report.retired if t.sizes)  # a retired one fused too
    assert stats.fused_launches > 0 and hits > 0, (
        f"a body whose shapes grow every iteration, repeated {program.reps} times without host reads, "
        f"was never fused by a shape-generic trace (stats: {stats}):\n{program.source()}")


# Programs outside CI's seed range that once differed or failed, (seed, style): what they found.
FOUND_BY_SEARCH = {
    (1008049, None): "a match handed to another trace after a sync had launched part of it: the "
                     "launch had freed a value the other trace still reads",
    (203079, "shapes"): "a shape-generic trace adopted as detection was given the ops the route "
                        "had matched in C++ (Note [Armed matching while detecting]): its start, "
                        "passed already, was moved on by the period of an earlier adoption (0)",
}


@pytest.mark.parametrize("seed, style", sorted(FOUND_BY_SEARCH, key=str))
def test_program_found_by_a_search_matches_eager(seed, style):
    check(generate(seed, style=style))


def test_programs_back_to_back_share_the_engine():
    """Traces cached by one program meet the next (similar shapes): re-entry and divergence."""
    _fresh_engine()
    for seed in range(2000, 2000 + CHAIN_PROGRAMS):
        check(generate(seed), fresh=False, context=(
            f"\n  (programs {list(range(2000, seed))} ran before it on the same engine, without a reset)"))


def test_generator_covers_every_feature():
    """The generator can fail to generate things: make sure the programs exercise each feature."""
    text = "".join(generate(s).source() for s in range(N_PROGRAMS))
    for needle in ("add_(", "mul_(", "copy_(", "index_put_(", "masked_fill_(", "dropout(", "rand_like(",
                   "bernoulli_(", "* lr", "cs", ".item()", ".tolist()", "print(", "bool(",
                   "torch.neuron.synchronize()", ".to('neuron'", "divergent iteration", "@", ".sum(",
                   "b_t", "a_rows", "vec_e", "w_v", "get_rng_state", "manual_seed(i)", "torch.rand(3)", "# view", "bfloat16",
                   "backward()", "aliasing changes", "ping-pong", "torch.full(", "neuron:1", "host mutation",
                   "drop the reference", "nonzero()", "multinomial", "out=", "repr(", "torch.equal(",
                   "scaled_dot_product_attention(", "dropout_p=", "rms_norm(", "linalg.cholesky(",
                   "linalg.solve(", "linalg.inv(", "linalg.det(", "linalg.qr(", "_assert_async("):
        assert needle in text, f"no generated program uses {needle!r}"
    assert sum(generate(s).diverges for s in range(N_PROGRAMS)) >= 20
    shapes = "".join(generate(s, style="shapes").source() for s in range(3000, 3000 + SHAPE_PROGRAMS))
    for needle in ("a growing cache", "torch.zeros(0, 6", "a length that cycles", "pad("):
        assert needle in shapes, f"no program of changing shapes uses {needle!r}"


def _rng_after_deferred_rand_like(mode: str):
    _fresh_engine()
    with adaptive_eager.mode(mode):
        torch.manual_seed(0)
        x = torch.ones(4, 6, device="neuron")
        for _ in range(4):
            w = torch.rand_like(x)
            q = (w * 2 + 1) * 3
        w = torch.rand_like(x)  # the cached trace's first op: deferred in adaptive mode
        state = torch.get_rng_state().clone()
        host = torch.rand(3)  # a host draw after it: the numbers after the rand_like's
        torch.manual_seed(7)  # must not reach the rand_like issued before it
        return state, w.cpu(), q.cpu(), host


def test_rng_state_sees_deferred_random_ops():
    (s_e, w_e, q_e, h_e), (s_a, w_a, q_a, h_a) = (_rng_after_deferred_rand_like("eager"),
                                                  _rng_after_deferred_rand_like("adaptive"))
    assert torch.equal(q_e, q_a) and torch.equal(h_e, h_a)
    assert torch.equal(w_e, w_a), "a rand_like issued before manual_seed drew from the reseeded generator"
    assert torch.equal(s_e, s_a), "get_rng_state() missed a random op issued before it"


def test_comparison_catches_each_kind_of_difference():
    """The harness itself: a changed read, value, signed zero, NaN, stride or RNG state is reported."""
    program = generate(7)
    base = run(program, "eager")
    assert differences(base, run(program, "eager")) == []

    def changed(edit):
        reads, final, rng, error, stats = base
        reads, final = list(reads), {k: list(v) if isinstance(v, tuple) else v for k, v in final.items()}
        rng = rng.clone()
        edit(reads, final, rng)
        final = {k: tuple(v) if isinstance(v, list) else v for k, v in final.items()}
        return differences(base, (reads, final, rng, error, stats))

    def set_value(value):
        def edit(reads, final, rng):
            final["a"][1] = final["a"][1].clone()
            final["a"][1][0, 0] = value
        return edit

    assert changed(lambda reads, final, rng: reads.__setitem__(-1, reads[-1] + "x"))
    assert changed(set_value(float(base[1]["a"][1][0, 0]) + 1))
    assert changed(set_value(float("nan")))
    assert changed(lambda reads, final, rng: final["a"].__setitem__(3, (1, 1)))  # stride
    assert changed(lambda reads, final, rng: rng.__setitem__(0, rng[0] ^ 1))
    assert changed(lambda reads, final, rng: None) == []
    def zero(value):
        return ["r"], {"z": ("tensor", torch.tensor([value]), (1,), (1,), torch.float32, "neuron:0")}, base[2], None, None

    signed, negative = zero(0.0), zero(-0.0)
    assert differences(signed, negative), "the sign of a zero must count"


def test_shrinker_keeps_the_failing_statement(monkeypatch):
    program = generate(3)
    culprit = program.body[len(program.body) // 2]
    monkeypatch.setattr(__import__(__name__), "_fails", lambda p: culprit in p.body)
    small = shrink(program)
    assert small.body == [culprit] and small.reps == 2


def test_step_ending_in_a_repeated_pair_is_fused():
    # Found by pure program seed 40998: the step's period was dropped as a multiple of a
    # 2-op period that held only over the step's last 4 ops.
    _fresh_engine()
    with adaptive_eager.mode("adaptive"):
        adaptive_eager.reset_stats()
        x = torch.ones(4, 6, device="neuron")
        for _ in range(10):
            y = x.exp().tanh().sigmoid().abs()
            y = (y * 2.0) - x
            y = (y * 3.0) - x  # the step ends with mul, sub, mul, sub: a 2-op period
        y.cpu()
        assert adaptive_eager.stats().fused_launches > 0, "10 identical 8-op steps never fused"
