"""`python -m pdserve.elastic_worker`: the process's flags and start-up live in
`pdserve.elastic_worker.process`, a library module the Ray actors call too."""

from pdserve.elastic_worker.process import main

if __name__ == "__main__":
    main()
