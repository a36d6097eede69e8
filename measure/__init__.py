"""The course's measurement drivers: each writes results/<gpu>/<name>.json (README.md maps every
stored results file to the command that makes it). Drivers import solutions, utils and
fa4_final; nothing imports them."""
