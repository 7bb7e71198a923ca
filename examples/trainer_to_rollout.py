"""A trainer process feeds its weights to a rollout process through one WeightBucket.

The rollout process stands in for an inference engine (vLLM, SGLang) in another
process: it keeps its own copy of the model and refreshes it in place every step.
The bucket is allocated and exported once; every sync reuses it, so device memory
stays flat, and its memory is in classic segments, so the rollout process needs no
``pidfd_getfd`` (which locked-down containers deny) even though the trainer runs
with expandable segments on.

Run on a GPU: ``python examples/trainer_to_rollout.py``. (Without one it says so and exits.)
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

import hybridmem as hm

logging.basicConfig(level=logging.INFO, format="%(processName)s %(name)s: %(message)s")


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()


def rollout(conn: Connection) -> None:
    """The consumer: opens the bucket once, then refreshes its weights every step."""
    print(hm.ipc_capabilities())  # what CUDA IPC can do here, and why not
    model = build()
    weights = model.state_dict()  # tensors that share the parameters' memory
    with hm.BucketReceiver(conn.recv()) as receiver:
        while conn.recv() == "sync":
            for _ in receiver.receive(conn, out=weights):  # filled in place
                pass
            conn.send(float(sum(w.double().sum() for w in weights.values())))


def reply(conn: Connection, timeout: float = 60.0) -> Any:
    """The rollout's next message: an error, never a hang, if it is stuck or has died."""
    if not conn.poll(timeout):
        raise TimeoutError(f"the rollout process sent nothing for {timeout:g} s")
    try:
        return conn.recv()
    except EOFError:  # its end closed: it exited (its traceback is printed above)
        raise RuntimeError("the rollout process exited before it answered") from None


def main() -> None:
    if not torch.cuda.is_available():
        print("trainer_to_rollout.py needs a CUDA GPU: nothing to do here")
        return
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    consumer = ctx.Process(target=rollout, args=(child,), name="rollout")
    consumer.start()
    child.close()  # the rollout's end is its own now: if it dies, reply() says so

    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hm.WeightBucket(16 << 20) as bucket:  # 16 MiB x 2 buffers, exported once
        conn.send(bucket.handle)
        for step in range(3):
            with hm.expandable_segments(True):  # training: less fragmentation
                loss = model(torch.randn(32, 1024, device="cuda")).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            conn.send("sync")
            report = bucket.send(model.state_dict(), conn)
            mine = float(sum(w.double().sum() for w in model.state_dict().values()))
            theirs = reply(conn)
            print(f"step {step}: loss {loss.item():.4f}; {report}; same weights: {mine == theirs}")
        conn.send("stop")
    consumer.join(timeout=60)
    if consumer.exitcode != 0:
        raise RuntimeError(f"the rollout process ended with exit code {consumer.exitcode}")


if __name__ == "__main__":
    main()
