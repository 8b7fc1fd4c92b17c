"""The integration tier: tests that start child processes (moe-rl commands, torchrun, servers, fresh interpreters) or run end to end; `make test-integration`."""
