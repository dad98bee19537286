"""``python -m mlx_actors``: the ``mlx-actors`` command line."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
