// "Copy" buttons: <button data-copy="id-of-an-input">. Copies the input's value to the clipboard and
// says so on the button; where the clipboard API is unavailable (plain HTTP off localhost), selects
// the text so that Ctrl-C copies it.
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const field = document.getElementById(button.dataset.copy);
  if (!field) return;
  field.select();
  try {
    await navigator.clipboard.writeText(field.value);
    button.textContent = "Copied";
  } catch (err) {
    button.textContent = "Selected: press Ctrl-C";
  }
});
