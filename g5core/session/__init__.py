"""The orchestrators: a deployment made into a plan and simulated (run, make_plan), prepared once for many steps (prepare), the closed-form Math path, and one collective alone (g5 collective)."""
