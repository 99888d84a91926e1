"""`python -m pdserve.decode_worker`: the process's flags and start-up live in
`pdserve.decode_worker.process`, a library module the Ray actors call too."""

from pdserve.omp_pool import prepare_process

prepare_process()  # before torch loads: its OpenMP reads the environment once

from pdserve.decode_worker.process import main  # noqa: E402

if __name__ == "__main__":
    main()
