"""Guards (recipe tables ``[[guard]]``): decide, on the device, whether an
update may be applied, or stop a run that has gone wrong. One module per
guard holds its config, its code and its registration."""
