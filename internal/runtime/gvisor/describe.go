package gvisor

// Describe is the one-line summary nodes advertise next to the runtime's
// name (cubecli node info, heartbeats): the platform it runs on.
func (d *Driver) Describe() string {
	s := "platform=" + d.platform
	if !d.checkpoint {
		s += " checkpoint=off"
	}
	return s
}
