"""`python -m pdserve.decode_worker`: the process's flags and start-up live in
`pdserve.decode_worker.process`, a library module the Ray actors call too."""

from pdserve.decode_worker.process import main

if __name__ == "__main__":
    main()
