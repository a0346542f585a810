# Install the daemon and the mount(8) helpers where mount(8) finds them.
PREFIX ?= /usr/local
SBIN ?= /sbin

.PHONY: install uninstall test
install:
	cargo install --locked --path fs --root $(PREFIX)
	cargo install --locked --path mount-helper --root $(PREFIX)
	ln -sf $(PREFIX)/bin/mount-converged $(SBIN)/mount.converged
	ln -sf $(PREFIX)/bin/mount-converged $(SBIN)/mount.fuse.converged

uninstall:
	rm -f $(SBIN)/mount.converged $(SBIN)/mount.fuse.converged
	rm -f $(PREFIX)/bin/converged $(PREFIX)/bin/mount-converged

test:
	cargo nextest run --workspace --no-fail-fast
