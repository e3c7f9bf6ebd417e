"""pycomm's tests, laid out as the source is: ddp/, grad/ (clip, ops), shm/, overlap/,
bench/, hosts/ (across hosts), integrations/ (Lightning, Accelerate, the HF Trainer,
pycomm.patch), packaging/ (install, build, README, imports); what they share is in
support/. A package, so that rank processes import a test module by its dotted name."""
