"""Share tensors that live in expandable segments with another process, zero copy, no pidfd.

A trainer keeps its memory in expandable segments (less fragmentation). torch would
send such a tensor as pid and fd numbers that the consumer copies out with
``pidfd_getfd``, which container seccomp profiles deny. hybridmem passes the fds
themselves over a private Unix socket instead; the rollout process maps the same
memory. Three ways, from the lowest level up:

1. ``hm.ipc_export(tensor)`` -> a picklable handle; the consumer calls ``.open()``;
2. a ``torch.multiprocessing`` queue inside ``hm.ipc_fd_sharing()``;
3. ``hm.WeightBucket(..., transport="fd")`` for every-step weight syncs.

Run on a GPU: ``python examples/expandable_sharing.py``. (Without one it says so and exits.)
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

import hybridmem as hm

logging.basicConfig(level=logging.INFO, format="%(processName)s %(name)s: %(message)s")


def rollout(conn: Connection, queue: Any) -> None:
    """The consumer: opens a handle, takes a tensor from a queue, then receives syncs."""
    weight = conn.recv().open()  # 1. the trainer's memory, mapped here
    conn.send(("handle", float(weight.sum())))
    weight[0, 0] = 42.0  # a write the trainer sees: the same memory
    torch.cuda.synchronize()
    conn.send("wrote")
    del weight  # unmaps; the trainer may now free it

    name, bias = queue.get(timeout=60)  # 2. through a queue
    conn.send((name, float(bias.sum())))
    del bias

    with hm.BucketReceiver(conn.recv()) as receiver:  # 3. a bucket in expandable segments
        weights = {name: tensor.clone() for name, tensor in receiver.receive(conn)}
    conn.send(("bucket", sorted(weights)))


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
        print("expandable_sharing.py needs a CUDA GPU: nothing to do here")
        return
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    queue = ctx.Queue()
    consumer = ctx.Process(target=rollout, args=(child, queue), name="rollout")
    consumer.start()
    child.close()  # the rollout's end is its own now: if it dies, reply() says so
    with hm.expandable_segments(True):  # the trainer's mode
        model = torch.nn.Linear(1024, 1024, device="cuda")
        torch.nn.init.ones_(model.weight)
        torch.nn.init.ones_(model.bias)

    conn.send(hm.ipc_export(model.weight.detach()))  # 1.
    print("rollout read", reply(conn))
    assert reply(conn) == "wrote"
    torch.cuda.synchronize()
    print("trainer sees the rollout's write:", float(model.weight[0, 0]))

    with hm.ipc_fd_sharing():  # 2. queue.put pickles in a thread: keep the scope open
        queue.put(("bias", model.bias.detach()))
        print("rollout read", reply(conn))

    with hm.WeightBucket(8 << 20, transport="fd") as bucket:  # 3.
        conn.send(bucket.handle)
        report = bucket.send(model.state_dict(), conn)
        print(report)
        print("rollout got", reply(conn))
    consumer.join(timeout=60)
    if consumer.exitcode != 0:
        raise RuntimeError(f"the rollout process ended with exit code {consumer.exitcode}")


if __name__ == "__main__":
    main()
