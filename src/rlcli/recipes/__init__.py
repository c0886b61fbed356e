"""The train commands: one module per recipe (sl, rl, dpo, opsd, harbor) over the pinned
cookbook, with what they share: options, preflight checks, the loss guard, dataset builders."""
