"""Layer 0: errors, precision, batches, collectives, process groups, environments, seeding, and the
checks that turn a hang into an error. Plain functions and small classes over torch; nothing here
imports another polytrain layer."""
