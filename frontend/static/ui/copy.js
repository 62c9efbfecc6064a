// "Copy" buttons: <button data-copy="id-of-an-input">. Copies the input's value to the clipboard and
// says so on the button; where the clipboard API is unavailable or refuses (plain HTTP off
// localhost, an unfocused page), selects the text so that Ctrl-C copies it.
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const field = document.getElementById(button.dataset.copy);
  if (!field) return;
  field.select();
  const refused = new Promise((_, reject) => setTimeout(() => reject(new Error("timeout")), 1000));
  try {
    if (!navigator.clipboard) throw new Error("no clipboard");
    await Promise.race([navigator.clipboard.writeText(field.value), refused]);
    button.textContent = "Copied";
  } catch (err) {
    button.textContent = "Selected: press Ctrl-C";
  }
});
