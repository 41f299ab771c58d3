"""The scheduler's processes, one per role, each put together from the rooms below: the
all-in-one scheduler (server: the client port, the engine and its executors in one process), a
planner (planner_server), a front-end (frontend_server), and one planner beside N front-end
processes behind one port (all_in_one); and what they share: the command line that picks the
role (role_flags), what a process is started with (server_settings), the client port as the
all-in-one scheduler and a front-end both serve it (client_port), and the settings of the
garbage collector and the C heap (gc_tuning, heap_tuning).
"""
