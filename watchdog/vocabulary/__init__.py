"""The words every floor speaks: the samples, findings and episodes (model), the stacks (stack_model), the
names of alerts (alert_identity), and how a verdict is said (words, telling). Imports nothing else of the
package but the configuration."""
