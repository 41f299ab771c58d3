"""`make run`: the whole system on this machine with the default model, asked one question.

    python -m scheduler_service.launch [--cache-dir DIR] [--port 50051] [--executor-port 50052]
        [--metrics-port 9400] [--threads N] [--host H] [--log-dir DIR] [--once] [--question TEXT]

Prepares SmolLM2-135M-Instruct once (python -m executor_service.prepare_model), starts one
executor and the scheduler as child processes, asks the question through the command-line client,
prints where everything listens, and serves until Ctrl-C or SIGTERM, when both children get
SIGTERM (then SIGKILL after a grace period) and the launcher exits 0. With --once it stops after
the answer and exits with the client's status. Port 0 picks a free port.

Terminal output for the user goes to stdout; the launcher's own log lines go to stderr; each
service logs to its own file, whose tail is shown if it dies.

Modules: options (command line), ports, commands (what each child runs, and its environment),
children (process supervision), banner (what the user reads), launcher (the steps in order),
__main__ (entry point).
"""
