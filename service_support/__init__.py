"""Shared runtime support for the splitserve services and their command lines: what every
service, the launcher and the clients do alike but that is no part of the wire contract
(protos/ holds that). Flags and their help (`cli_help`, `flag_types`, `local_folder`,
`default_ports`), logging (`log_format`), TLS from flags (`transport_security`), the plaintext
health port for probes (`health_port`), binding checks before a slow start (`port_check`),
ending with the parent process (`parent_death`), and `splitserve executor-token` (`make_token`).

It may import protos/ (the contract), never a service package."""
