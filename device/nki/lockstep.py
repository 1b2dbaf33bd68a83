"""Programs of one launch that meet at collectives, run deterministically.

Note [Lockstep programs]: the programs of a grid run on threads of their own (so that one
can wait at `core_barrier` or `sendrecv` for another), but only one runs at a time: a
program holds the turn until it finishes or reaches a collective, then hands it to the
next program in order. So a kernel without collectives runs its programs one after another
as before, and one with collectives interleaves them the same way every time: the values,
and the order the timeline sees instructions in, never depend on the OS scheduler.
A collective completes when every program it names has reached it; a program that
finishes, or fails, while another waits for it ends the launch with an error naming both.
"""
from __future__ import annotations

import threading

from .errors import NkiValidationError


class LaunchAborted(Exception):
    """Raised in a program's thread when another program of the launch failed."""


class Lockstep:
    def __init__(self, programs: int):
        self.n = programs
        self.turn = 0
        self.done = [False] * programs
        self.waiting: dict[int, tuple] = {}  # program -> (collective key, participants)
        self.arrived: dict[tuple, dict[int, object]] = {}  # collective key -> {program: payload}
        self.completed: dict[int, dict] = {}  # program -> the payloads of its completed collective
        self.failure: BaseException | None = None
        self.cond = threading.Condition()

    # --- turns ------------------------------------------------------------------------------
    def wait_turn(self, me: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me or self.failure is not None)
            if self.failure is not None:
                raise LaunchAborted()

    def _pass_turn(self, me: int) -> None:
        """Hand the turn to the next program that can run (caller holds the lock)."""
        for step in range(1, self.n + 1):
            other = (me + step) % self.n
            if not self.done[other] and other not in self.waiting:
                self.turn = other
                self.cond.notify_all()
                return
        if self.waiting and self.failure is None:  # every program left waits: none will arrive to release them
            stuck = ", ".join(f"program {p} at {describe(key)}" for p, (key, _) in sorted(self.waiting.items()))
            self.failure = NkiValidationError(f"the programs of the launch wait for each other forever: {stuck}")
            self.cond.notify_all()

    def finish(self, me: int) -> None:
        with self.cond:
            self.done[me] = True
            for p, (key, parts) in self.waiting.items():
                if me in parts:
                    self.failure = NkiValidationError(
                        f"program {me} finished while program {p} waits for it at {describe(key)}; every program "
                        f"named by a collective must reach it")
            self._pass_turn(me)
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = error
            self.cond.notify_all()

    # --- collectives --------------------------------------------------------------------------
    def meet(self, me: int, key: tuple, participants: tuple[int, ...], payload, on_complete) -> dict:
        """Arrive at collective `key` with `payload`; return {program: payload} of every
        participant once all have arrived. `on_complete(payloads)` runs once, in the last
        arriving program, before anyone goes on."""
        if me not in participants or any(not 0 <= p < self.n for p in participants):
            raise NkiValidationError(f"{describe(key)}: program {me} of {self.n} names programs {participants}")
        with self.cond:
            group = self.arrived.setdefault(key, {})
            if me in group:
                raise NkiValidationError(f"{describe(key)}: program {me} arrived twice before the others")
            group[me] = payload
            if set(group) == set(participants):
                del self.arrived[key]
                on_complete(group)
                for p in participants:
                    self.waiting.pop(p, None)
                    self.completed[p] = group
                self.cond.notify_all()
            else:
                self.waiting[me] = (key, participants)
                self._pass_turn(me)
            # released, the program runs again once the turn comes back to it
            self.cond.wait_for(lambda: (me in self.completed and self.turn == me) or self.failure is not None)
            if self.failure is not None:
                raise LaunchAborted()
            return self.completed.pop(me)


class RankView:
    """The programs of one rank of a rank launch (ranks.py) seen as a launch of their own: a
    launch-wide Lockstep runs every rank's programs, and core_barrier or sendrecv between a
    rank's NeuronCores name programs 0..P-1 of that rank. Indices are shifted by the rank's
    first program, and keys are the rank's own, so rank 0's core_barrier #1 never meets rank 1's."""

    def __init__(self, lockstep: Lockstep, base: int, programs: int, rank: int):
        self.lockstep, self.base, self.n, self.rank = lockstep, base, programs, rank

    def meet(self, me: int, key: tuple, participants: tuple[int, ...], payload, on_complete) -> dict:
        if any(not 0 <= p < self.n for p in participants):
            raise NkiValidationError(f"{describe(key)}: program {me} of {self.n} names programs {participants}")
        kind, pipe, n = key
        mine = (f"{kind} of rank {self.rank}", pipe, n)

        def local(arrived: dict) -> dict:
            return {p - self.base: v for p, v in arrived.items()}

        got = self.lockstep.meet(self.base + me, mine, tuple(self.base + p for p in participants), payload,
                                 lambda arrived: on_complete(local(arrived)))
        return local(got)


def describe(key: tuple) -> str:
    """'core_barrier #2' or 'sendrecv pipe 0 #1': which collective of a program."""
    kind, pipe, n = key
    return f"{kind}{'' if pipe is None else f' pipe {pipe}'} #{n + 1}"


def run_programs(n: int, body) -> None:
    """Run body(i) for i in range(n) on threads, in lockstep (Note [Lockstep programs])."""
    step = Lockstep(n)
    errors: list[BaseException] = []

    def program(i: int):
        try:
            step.wait_turn(i)
            body(i, step)
        except LaunchAborted:
            return
        except BaseException as error:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(error)
            step.fail(error)
            return
        step.finish(i)

    threads = [threading.Thread(target=program, args=(i,), name=f"nki-program-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if step.failure is not None:
        raise step.failure
