"""The run-state store: every write of run state (runs, claims, the step ledger,
worker boots, the outbox) and the statements behind it live in this package."""
