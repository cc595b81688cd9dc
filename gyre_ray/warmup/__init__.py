"""A supervised warm-up before RL: synthetic transcripts of the toy harness teach a random policy the chat
and tool-call format, so RL on a small answer space (the `words` task set) has something to shift."""
