"""`python -m pdserve.prefill_worker`: the process's flags and start-up live in
`pdserve.prefill_worker.process`, a library module the Ray actors call too."""

from pdserve.prefill_worker.process import main

if __name__ == "__main__":
    main()
