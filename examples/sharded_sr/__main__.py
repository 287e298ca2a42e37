"""``mpiexec -n 2 python -m examples.sharded_sr [options]``."""

from .run import main

if __name__ == "__main__":
    main()
