"""``python -m pdserve.router``: the router process's flags and start-up live in `pdserve.router.process`,
a library module the Ray router actor calls too."""

from pdserve.router.process import main

if __name__ == "__main__":
    raise SystemExit(main())
