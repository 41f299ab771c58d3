"""Structured outputs: grammars compiled with xgrammar, and each constrained request's place in
its grammar (the planning core's TokenConstraint)."""
