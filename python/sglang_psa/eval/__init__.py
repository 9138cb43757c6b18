"""Long-context evaluation: seeded task generator and the policy-comparison runner."""
