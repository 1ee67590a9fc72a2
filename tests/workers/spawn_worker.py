"""torchrun worker for tests: one rank of `launch.spawn(fn, args, nprocs)`, which stands
for `torch.multiprocessing.spawn(fn, args, nprocs)`: `fn(rank, *args)` in a process forked
by the zygote with its imports done, where spawn started a fresh interpreter per rank.
argv: the job file launch.spawn wrote (the test directories to import `fn`'s module
from, as spawn passes pytest's sys.path, then the pickled fn and args), then
`--output DIR` (unused). `fn` makes its own process group, as under spawn: the agent's
store is not offered to it."""
import os
import pickle
import sys


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        paths, payload = pickle.load(f)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    fn, args = pickle.loads(payload)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # fn's env:// store is its own
    fn(int(os.environ["LOCAL_RANK"]), *args)


if __name__ == "__main__":
    main()
