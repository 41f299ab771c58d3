"""The scheduler service, in rooms that import only the rooms before them here: core (requests,
queues and policies, the step planner; no torch and no gRPC), text (tokenizer and detokenizer),
frontend (the client API), planner (the engine that drives executors), tier (the Planner API
between front-ends and planners), process (each role's process), then the replay and launch
tools (tests/scheduler/test_scheduler_rooms.py)."""
