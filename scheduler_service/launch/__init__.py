"""`make run` and `splitserve serve`: the whole system on this machine in one command.

    python -m scheduler_service.launch [--model DIR | --cache-dir DIR] [--port 50051]
        [--executor-port 50052] [--metrics-port 9400] [--gateway-port 8000] [--threads N]
        [--host H] [--log-dir DIR] [--once] [--question TEXT] [-v]
    splitserve serve MODEL_DIR [the same flags but --model and --cache-dir]

`run` prepares SmolLM2-135M-Instruct once (python -m executor_service.prepare_model) unless
--model names a folder of the user's own; `serve` takes that folder as its argument and asks
nothing. Both start one executor, the scheduler and the OpenAI-compatible gateway as child
processes, ask the question (if any) through the command-line client, print where everything
listens, and serve until Ctrl-C or SIGTERM, when every child gets SIGTERM (then SIGKILL after a
grace period) and the launcher exits 0. With --once it stops after the answer and exits with
the client's status. Port 0 picks a free port. A child that fails to start is reported in two
lines: which, and its own last error line (-v: the last lines of its log).

Terminal output for the user goes to stdout; the launcher's own log lines go to stderr; each
service logs to its own file, whose tail is shown if it dies.

Modules: options (command line), ports, commands (what each child runs, and its environment),
children (process supervision), banner (what the user reads), launcher (the steps in order),
__main__ (entry point).
"""
