"""ldtools: the command-line tools for ldformat chains."""
